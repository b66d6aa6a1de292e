"""Megatron-core trainer model: CPU shim, config adapter, HF conversion, router replay and checkpoints."""
