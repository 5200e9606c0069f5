"""Embedded rollout server: continuous batching vs one request at a time.

A small random Qwen2 (hidden 256, 4 layers, vocab 4096) served by
``python -m areal_mcore.rollout.embedded.server``; 64 concurrent requests of 64 new tokens are
timed against the same requests sent one at a time, over HTTP, in one run. Prints tokens/s
and the ratio; the numbers depend on the machine, the ratio is the claim.
Run: ``python bench/rollout_server.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from areal_mcore.rollout.client import ClientConfig, RolloutClient
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.protocol import SamplingParams
from areal_mcore.rollout.servers import launch_servers

RESULTS = Path(__file__).parent / "results" / "rollout_server.json"
N, NEW_TOKENS, SEQUENTIAL = 64, 64, 8


def small_model_dir(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(root)
    return root


async def measure(address: str) -> dict:
    prompts = [[(7 * i + k) % 4000 + 10 for k in range(32)] for i in range(N)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with RolloutClient(ClientConfig(addresses=[address])) as client:
        await client.generate(prompts[0], params)  # warm-up
        t = time.perf_counter()
        for p in prompts[:SEQUENTIAL]:
            await client.generate(p, params)
        one = SEQUENTIAL * NEW_TOKENS / (time.perf_counter() - t)
        t = time.perf_counter()
        outs = await asyncio.gather(*[client.generate(p, params) for p in prompts])
        batched = sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t)
    return {"one_at_a_time_tok_s": round(one, 1), "batched_64_tok_s": round(batched, 1),
            "ratio": round(batched / one, 2)}


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        cfg = ServerConfig(model_path=small_model_dir(root), dtype="float32", context_length=1024,
                           log_dir=os.path.join(root, "logs"), max_running_requests=N)
        server = launch_servers(cfg)[0]
        try:
            result = asyncio.run(measure(server.address))
        finally:
            server.stop()
    result["threads"] = torch.get_num_threads()
    print(f"one at a time: {result['one_at_a_time_tok_s']} tok/s   64 concurrent: "
          f"{result['batched_64_tok_s']} tok/s   ratio {result['ratio']}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
