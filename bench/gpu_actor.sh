#!/usr/bin/env bash
# GPU check for the actor (one GPU, <= 10 min): ~1B Qwen2-shaped model, local spec, bf16.
# Needs torch (CUDA), megatron-core and transformers importable by python3.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 540 torchrun --standalone --nproc_per_node 1 bench/gpu_actor.py "$@"
