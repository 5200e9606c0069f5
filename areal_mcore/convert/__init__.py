"""Checkpoint conversion: megatron dist checkpoints (any TP/PP) <-> HF safetensors folders."""
