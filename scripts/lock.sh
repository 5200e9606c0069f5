#!/usr/bin/env bash
# `make lock`: regenerate the lock files in locks/ from locks/*.in and setup.py, at the newest
# versions they allow. A deliberate change: review the diff, run `make test` on a fresh clone,
# and commit the locks on their own. Installs (`make install`, `run`, `test`) read only the locks.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
# Where the CPU torch wheel is (the Makefile's TORCH_LINKS): it is not on PyPI.
TORCH_LINKS=(--find-links "${TORCH_LINKS:?set by the Makefile}")
compile() {  # compile OUT PYTHON_VERSION SOURCES_AND_uv_FLAGS...
  local out=$1 py=$2
  shift 2
  "$UV" pip compile --quiet --upgrade --generate-hashes --python-version "$py" \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
    --output-file "$out" "$@"
}
compile locks/main.txt 3.11 setup.py --extra dev locks/main.in "${TORCH_LINKS[@]}"
compile locks/vllm.txt 3.11 locks/vllm.in "${TORCH_LINKS[@]}" \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
compile locks/mcore019.txt 3.12 setup.py --extra dev locks/mcore019.in
# SGLang's wheels are downloaded, not installed: their sha256 is the lock.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for v in 0.5.23 0.5.20; do
  python3 -m pip download --quiet --no-deps --dest "$tmp" "sglang==$v"
done
(cd "$tmp" && sha256sum sglang-*.whl) >locks/sglang.sha256
git --no-pager diff --stat -- locks/
