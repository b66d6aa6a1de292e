"""Rollout producers: engine clients (SGLang HTTP), the CPU engine, prompt sources, rewards and the producer loop."""
