"""Prefix caching through our client + vLLM: a group's samples share its prompt's KV.

Launches one vLLM server with prefix caching (vLLM's default) and one without, one after
the other in this process, and sends each the same load through ``RolloutClient`` with
group affinity (``generate(group=...)``, as the rollout controller does): 8 prompts x 16
samples x 384-token prompts, 32 new tokens, temperature 1. Prints the seconds of each and
the ratio (no cache / cache). Needs the vLLM venv (`make install-vllm`).

    .venv/bin/python bench/vllm_prefix_cache.py [--prompts 8] [--samples 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import torch


def tiny_model(path: str) -> str:
    """A random 4-layer hidden-256 Qwen2 (head_dim 32: vLLM's CPU attention serves it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).float().save_pretrained(path)
    return path


async def load(address: str, prompts: list[list[int]], samples: int, new_tokens: int) -> float:
    from areal_mcore.rollout.client import ClientConfig, RolloutClient
    from areal_mcore.rollout.protocol import SamplingParams

    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    async with RolloutClient(ClientConfig(addresses=[address], backend="vllm")) as client:
        t = time.perf_counter()
        await asyncio.gather(*[client.generate(p, sampling, group=str(i))
                               for i, p in enumerate(prompts) for _ in range(samples)])
        return time.perf_counter() - t


def main() -> None:
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.engines.options import VLLMOptions
    from areal_mcore.rollout.servers import launch_servers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (a.prompt_tokens,), generator=g).tolist()
               for _ in range(a.prompts)]
    out = {}
    with tempfile.TemporaryDirectory() as root:
        model = tiny_model(os.path.join(root, "model"))
        for name, extra in (("prefix_cache", []), ("no_prefix_cache", ["--no-enable-prefix-caching"])):
            cfg = ServerConfig(model_path=model, backend="vllm", dtype="float32", context_length=1024,
                               max_running_requests=128, log_dir=os.path.join(root, name), extra_args=extra,
                               vllm=VLLMOptions(kv_cache_memory_mb=512, enforce_eager=True))
            server, = launch_servers(cfg)
            try:
                asyncio.run(load(server.address, prompts[:1], 2, 4))  # warm-up
                out[name] = asyncio.run(load(server.address, prompts, a.samples, a.new_tokens))
            finally:
                server.stop()
    out["ratio"] = out["no_prefix_cache"] / out["prefix_cache"]
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
