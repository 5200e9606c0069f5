"""Orchestration: the RL loop, SFT, checkpoints."""
