#!/usr/bin/env bash
# The tiny CPU boba run end to end (what `make run` calls): offline assets -> SFT warm-up
# -> boba PPO with an embedded rollout server and weight sync. Extra arguments are
# config overrides for the PPO run, e.g. trainer.total_steps=5.
set -euo pipefail
PY=${PY:-.venv/bin/python}
CONFIG=configs/tiny_cpu.yaml
RUN=runs/tiny-cpu
if [ ! -f "$RUN/assets/model/config.json" ]; then
  "$PY" -m areal_mcore.data.tiny_assets --out "$RUN/assets"
fi
if [ ! -f "$RUN/sft_model/config.json" ]; then
  "$PY" -m areal_mcore.cli sft --config "$CONFIG" actor.optimizer.lr=3e-3
fi
rm -f "$RUN/stats.jsonl" "$RUN/eval.jsonl"
"$PY" -m areal_mcore.cli train --config "$CONFIG" "$@"
echo
echo "assets (data, tokenizer, base model): $RUN/assets"
echo "SFT-warmed model (HF):                $RUN/sft_model"
echo "per-step stats (JSON lines):          $RUN/stats.jsonl"
echo "held-out accuracy (JSON lines):       $RUN/eval.jsonl"
echo "rollout server logs:                  $RUN/servers"
