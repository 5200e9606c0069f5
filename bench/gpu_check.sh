#!/usr/bin/env bash
# The prepared GPU check (one GPU, about 5 minutes on an H200; one command, under 10 with the
# install): the default training path on the device, written to bench/results/gpu_check.json
# (bench/gpu_check.py says what each part checks). Its Python part also runs in the test
# suite on an emulated CUDA device (tests/test_gpu_check.py): what is new here is real CUDA
# (NCCL, TE if importable, SDPA's fused kernels, compiled Triton, memory and time).
#
# The GPU machine needs Python 3.12 with a CUDA PyTorch (2.11 tested by design) and Triton,
# and no network: everything else comes from a folder of wheels, WHEELS: megatron-core and
# this project's other dependencies (setup.py's INSTALL_REQUIRES; the check imports the
# trainer, the weight sync and the embedded server's receive path, so aiohttp, datasets and
# the rest are needed too). Prepare it on a machine with network access; torch and triton
# stay out (the GPU machine's own are used):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
#      --platform manylinux_2_28_x86_64 --platform any -d wheels"
#   pip download $P --no-deps megatron-core==0.16.1      # --no-deps: it would pull CUDA torch
#   sed -n '/^INSTALL_REQUIRES/,/^]/p' setup.py | grep -o '^ *"[^"]*"' | tr -d ' "' \
#       | grep -v -e '^torch' -e '^megatron-core' > reqs.txt
#   pip download $P -r reqs.txt packaging setuptools wheel
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
"$VENV/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" setuptools wheel megatron-core==0.16.1
# With its dependencies, from WHEELS; torch>=2.6 is the machine's own (system site packages).
"$VENV/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" --no-build-isolation -e .
echo "[gpu_check] installed in $((SECONDS - start)) s"
mkdir -p bench/results
# One rank; torchrun sets LOCAL_RANK, which bind_local_device reads. As a module (-m), so
# that bench/ imports and the weight receiver's spawned process finds the check again.
timeout 480 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 1 -m bench.gpu_check "$@"
echo "[gpu_check] done in $((SECONDS - start)) s: bench/results/gpu_check.json"
