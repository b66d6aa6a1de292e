"""Rollout producers: engine clients (SGLang HTTP), the CPU engine, the prompt cursor, rewards and the producer loop."""
