"""THD packing + allocator vs padding each micro-batch to its longest sequence.

Same megatron model (local spec, CPU, one gloo rank), same sequences (prompt + long-tail
lognormal responses), same token budget per micro-batch. The padded baseline takes the
sequences in batch order and closes a micro-batch when (n + 1) x longest would exceed
the budget, as a padded [b, s] trainer must. Each path runs forward + backward of the
token NLL over its micro-batches; the table reports real tokens/s, the padding fraction
and the ratio. Run: ``python bench/packed_vs_padded.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areal_mcore.packing import allocate_micro_batches, pack

RESULTS = Path(__file__).parent / "results" / "packed_vs_padded.json"


def long_tail_lengths(rng: np.random.Generator, n: int, max_len: int) -> list[int]:
    prompts = rng.integers(16, 96, size=n)
    responses = np.clip(rng.lognormal(np.log(max_len / 8), 1.0, size=n), 1, max_len - 96)
    return (prompts + responses.astype(int)).tolist()


def padded_groups(lens: list[int], cap: int) -> list[list[int]]:
    groups, cur = [], []
    for i in range(len(lens)):
        if cur and (len(cur) + 1) * max(lens[j] for j in cur + [i]) > cap:
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + [cur]


def _nll(logits, targets, mask):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    loss = vocab_parallel_cross_entropy(logits.float().contiguous(), targets.contiguous())
    return (loss * mask).sum()


def run_packed(model, seqs, bins):
    from megatron.core.packed_seq_params import PackedSeqParams

    for b in bins:
        batch = pack([seqs[i] for i in b])
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                                 max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)
        logits = model(batch.input_ids[None], batch.position_ids[None], attention_mask=None,
                       packed_seq_params=params)  # [1, T, V]
        targets = torch.roll(batch.input_ids, -1)
        mask = torch.ones_like(targets, dtype=torch.float)
        mask[batch.cu_seqlens[1:].long() - 1] = 0  # no target after a sequence's last token
        _nll(logits.transpose(0, 1), targets[:, None], mask[:, None]).backward()


def run_padded(model, seqs, groups):
    for g in groups:
        longest = max(len(seqs[i]) for i in g)
        ids = torch.zeros(len(g), longest, dtype=torch.long)
        mask = torch.zeros(len(g), longest)
        for r, i in enumerate(g):
            ids[r, : len(seqs[i])] = seqs[i]
            mask[r, : len(seqs[i]) - 1] = 1
        pos = torch.arange(longest)[None].expand(len(g), -1)
        logits = model(ids, pos, attention_mask=None)  # [b, s, V]; causal, padding at the end
        targets = torch.roll(ids, -1, dims=1)
        _nll(logits.transpose(0, 1), targets.t(), mask.t()).backward()


def main(n_seqs: int = 96, max_len: int = 2048, cap: int = 4096, repeats: int = 2, out: Path = RESULTS):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    from transformers import Qwen2Config

    from areal_mcore.actor.config import ParallelConfig
    from areal_mcore.actor.parallel import init_parallel
    from areal_mcore.model.args import ModelArgs
    from areal_mcore.model.hf_config import build_gpt_model, transformer_config

    torch.manual_seed(0)
    init_parallel(ParallelConfig(), seed=1)
    hf = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_len)
    args = ModelArgs.from_hf(hf)
    config = transformer_config(args, tp_size=1, pp_size=1, params_dtype=torch.float32)
    model = build_gpt_model(args, config, padded_vocab=2048, use_te=False, pre_process=True, post_process=True)

    rng = np.random.default_rng(0)
    lens = long_tail_lengths(rng, n_seqs, max_len)
    seqs = [torch.randint(0, 2048, (n,)) for n in lens]
    bins = allocate_micro_batches(lens, cap)
    groups = padded_groups(lens, cap)
    real = sum(lens)
    padded_tokens = sum(len(g) * max(lens[i] for i in g) for g in groups)

    times = {"packed": [], "padded": []}
    for _ in range(repeats):  # interleaved, so drift hits both paths alike
        for name, fn, arg in (("packed", run_packed, bins), ("padded", run_padded, groups)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn(model, seqs, arg)
            times[name].append(time.perf_counter() - t0)
    packed_s, padded_s = min(times["packed"]), min(times["padded"])
    row = {
        "sequences": n_seqs, "real_tokens": real, "cap": cap,
        "packed_micro_batches": len(bins), "padded_micro_batches": len(groups),
        "padding_fraction": 1 - real / padded_tokens,
        "packed_tokens_per_s": real / packed_s, "padded_tokens_per_s": real / padded_s,
        "speedup": padded_s / packed_s,
    }
    print(f"{'path':<8} {'micro-batches':>13} {'tokens/s':>10} {'seconds':>8}")
    print(f"{'packed':<8} {len(bins):>13} {row['packed_tokens_per_s']:>10.0f} {packed_s:>8.2f}")
    print(f"{'padded':<8} {len(groups):>13} {row['padded_tokens_per_s']:>10.0f} {padded_s:>8.2f}")
    print(f"padding fraction of the padded path: {row['padding_fraction']:.1%}")
    print(f"packed / padded tokens/s: {row['speedup']:.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
