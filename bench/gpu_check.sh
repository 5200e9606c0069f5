#!/usr/bin/env bash
# The prepared GPU check (one GPU, <= 8 minutes on an H200; not part of the test suite):
# the actor on a ~1B Qwen2 shape (fp32 logprobs vs transformers on the CPU <= 1e-4; bf16
# tokens/s and MFU), the Triton logprob and GAE kernels vs the torch path (values,
# gradients, time, peak memory), device binding and the collectives/dispatch paths on NCCL
# at world size 1. Writes bench/results/gpu_check.json (see bench/gpu_check.py).
#
# The GPU machine needs Python 3.12 with a CUDA PyTorch (2.11 tested by design) and Triton,
# and no network: everything else comes from a folder of wheels, WHEELS. Prepare it on a
# machine with network access (torch and triton stay out: the GPU machine's own are used):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
#      --platform manylinux_2_28_x86_64 --platform any -d wheels"
#   pip download $P --no-deps megatron-core==0.16.1      # --no-deps: it would pull CUDA torch
#   pip download $P "transformers>=5.0" omegaconf psutil safetensors pyyaml tqdm numpy packaging \
#       setuptools wheel
# Then, from the repository root on the GPU machine:
#   WHEELS=/path/to/wheels bash bench/gpu_check.sh [--steps 4 --seqs 64 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${WHEELS:?set WHEELS to the folder of wheels (see the header of bench/gpu_check.sh)}"
PY=${PY:-python3}
VENV=${VENV:-${TMPDIR:-/tmp}/areal_gpu_check_venv}
start=$SECONDS
"$PY" -c 'import torch, triton, sys; assert torch.cuda.is_available(), "no CUDA GPU visible"
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__}")'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# The venv sees the machine's torch and triton; pip never reaches an index (--no-index).
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" \
  megatron-core==0.16.1 "transformers>=5.0" omegaconf psutil safetensors pyyaml tqdm
"$VENV/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --no-build-isolation -e .
echo "[gpu_check] installed in $((SECONDS - start)) s"
mkdir -p bench/results
# One rank; torchrun sets LOCAL_RANK, which bind_local_device reads.
timeout 420 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_check.py "$@"
echo "[gpu_check] done in $((SECONDS - start)) s: bench/results/gpu_check.json"
