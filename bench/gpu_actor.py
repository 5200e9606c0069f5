"""GPU throughput check of the actor: a ~1B Qwen2-shaped random model, local layer spec,
bf16, one GPU, a few train steps on long-tail THD batches; prints tokens/s and MFU.

MFU counts 6·N FLOPs per token for the matmuls (N = non-embedding params + lm head)
plus 6·L·d·s̄ for causal attention (s̄ = mean sequence length), against the bf16 dense
peak given by --peak-tflops (H200/H100 SXM: 989).
Run through bench/gpu_actor.sh (torchrun, one process).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
from areal_mcore.actor.megatron_actor import MegatronActor
from areal_mcore.devices import bind_local_device
from areal_mcore.packing import pack


def nll(logp, mb, tokens, seqs):
    mask = mb.fields["loss_mask"]
    return -(logp * mask).sum() / tokens, {}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--mb-tokens", type=int, default=16384)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    bind_local_device()  # LOCAL_RANK's GPU, before NCCL and megatron touch CUDA
    dist.init_process_group("nccl")
    from transformers import Qwen2Config

    hf = Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=a.max_len,
                     tie_word_embeddings=True, rope_theta=1e6)
    cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=a.mb_tokens),
                      optimizer=OptimizerConfig(lr=1e-5, eps=1e-5), dtype="bfloat16", layer_spec="local")
    actor = MegatronActor(cfg, hf, total_optimizer_steps=a.steps)
    n_params = sum(p.numel() for p in actor.model.module.parameters())
    L, d = hf.num_hidden_layers, hf.hidden_size
    rng = np.random.default_rng(0)
    times, tokens = [], 0
    for step in range(a.steps):
        lens = np.clip(rng.lognormal(np.log(a.max_len / 6), 1.0, a.seqs), 64, a.max_len).astype(int)
        seqs = [torch.randint(0, hf.vocab_size, (int(n),)) for n in lens]
        batch = pack(seqs, {"loss_mask": [torch.ones(len(s)) for s in seqs]})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = actor.train_batch(batch, nll, n_minibatches=1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step:  # the first step pays for allocation and kernel selection
            times.append(dt)
            tokens += int(lens.sum())
        mean_len = float(lens.mean())
        print(f"step {step}: {lens.sum()} tokens in {dt:.2f}s, loss {out['loss'][0]:.3f}, "
              f"micro-batches {out['n_micro_batches'][0]}")
    tps = tokens / sum(times)
    flops_per_token = 6 * n_params + 6 * L * d * mean_len
    mfu = tps * flops_per_token / (a.peak_tflops * 1e12)
    print(f"params {n_params / 1e9:.2f}B  tokens/s {tps:.0f}  MFU {mfu:.1%}  "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
