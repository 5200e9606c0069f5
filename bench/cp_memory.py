"""Activation memory per rank under context parallelism: one long sequence at cp 1, 2, 4.

One 4096-token sequence through ``MegatronActor.train_batch`` on a tiny random Qwen2 (the
tests' shape: hidden 64, 4 layers, 4 query / 2 KV heads of 16, FFN 96, vocab 250; fp32, CPU,
the local spec), in gloo worlds of 1, 2 and 4 ranks at cp = world size and
``max_tokens_per_mb`` = 4096 / cp, so each rank holds its 1/cp share of the row in one
micro-batch. Measured: the peak bytes autograd saved on each rank
(``actor.activation_memory.SavedActivationMeter``), printed with the ratio of the largest
rank's to cp=1's (the baseline, measured in the same run), next to the memory planner's
prediction for the rank it plans (``plan.memory``, local path: CP rank 0, whose sequences'
first chunks keep their attention output). Run: ``python bench/cp_memory.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_mcore.net import free_port

RESULTS = Path(__file__).parent / "results" / "cp_memory.json"
SHAPE = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def _hf_config(seq_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPE, max_position_embeddings=seq_len, use_sliding_window=False)


def _nll(logp, mb, tokens, seqs):
    return -(logp * mb.fields["loss_mask"]).sum() / tokens, {}


def _rank(rank: int, world: int, port: int, seq_len: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from areal_mcore.actor.activation_memory import SavedActivationMeter
        from areal_mcore.actor.config import (
            ActorConfig,
            MicroBatchSpec,
            OptimizerConfig,
            ParallelConfig,
        )
        from areal_mcore.actor.megatron_actor import MegatronActor
        from areal_mcore.packing import pack

        torch.manual_seed(0)
        cfg = ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=seq_len // world),
                          optimizer=OptimizerConfig(lr=1e-3), parallel=ParallelConfig(cp=world),
                          vocab_divisible_by=8)
        actor = MegatronActor(cfg, _hf_config(seq_len), total_optimizer_steps=1)
        g = torch.Generator().manual_seed(3)
        seq = [torch.randint(0, SHAPE["vocab_size"], (seq_len,), generator=g)]
        batch = pack(seq, {"loss_mask": [torch.arange(seq_len) >= 16]})
        with SavedActivationMeter(actor.model.parameters()) as meter:
            out = actor.train_batch(batch, _nll)
        queue.put((rank, pickle.dumps({"peak": meter.peak_bytes, "n_mb": out["n_micro_batches"][0],
                                       "cp": actor.groups.cp_size}), None))
    except BaseException as e:  # the parent fails with the rank's error
        queue.put((rank, None, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(world: int, seq_len: int) -> list[dict]:
    """Each rank's measurement in a fresh gloo world of ``world`` ranks (cp = world)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, seq_len, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    errors = [err for _, _, err in results if err]
    if errors:
        raise RuntimeError("a rank failed: " + "; ".join(errors))
    return [pickle.loads(value) for _, value, _ in results]


def predict(cp: int, seq_len: int) -> float:
    from areal_mcore.model.args import ModelArgs
    from areal_mcore.plan.memory import TrainerShape, trainer_rank

    args = ModelArgs.from_hf(_hf_config(seq_len))
    shape = TrainerShape(cp=cp, tokens_per_mb=seq_len // cp, n_micro_batches=1,
                         dtype_bytes=4, path="local", vocab_divisible_by=8)
    return trainer_rank(args, shape, 0).terms["activations"]


def main(seq_len: int = 4096, cps=(1, 2, 4), out: Path = RESULTS) -> dict:
    rows = []
    for cp in cps:
        ranks = measure(cp, seq_len)
        assert all(r["cp"] == cp and r["n_mb"] == 1 for r in ranks), ranks
        rows.append({"cp": cp, "tokens_per_rank": seq_len // cp, "peak_per_rank": [r["peak"] for r in ranks],
                     "peak": max(r["peak"] for r in ranks), "predicted": predict(cp, seq_len)})
    base = rows[0]["peak"]
    print(f"one {seq_len}-token sequence, tiny Qwen2 (fp32, CPU, local spec): bytes saved for backward per rank")
    print(f"{'cp':>3} {'tokens/rank':>11} {'largest rank':>13} {'x cp=1':>7} {'planned':>12} {'plan err':>8}  per rank")
    for r in rows:
        r["ratio"] = r["peak"] / base
        r["predicted_error"] = r["predicted"] / r["peak"] - 1
        print(f"{r['cp']:>3} {r['tokens_per_rank']:>11} {r['peak']:>13} {r['ratio']:>6.2f}x {r['predicted']:>12.0f} "
              f"{r['predicted_error']:>+7.1%}  {r['peak_per_rank']}")
    row = {"seq_len": seq_len, "model": SHAPE, "dtype": "float32", "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
