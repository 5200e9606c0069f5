"""Weight sync on CPU/gloo: our bucketed sync vs one raw broadcast of the same bytes.

A random ~156M-parameter Qwen2 (hidden 1024, 8 layers, vocab 32k) as a megatron actor
(TP=1, bf16 as the boba recipes train; ``--actor-dtype float32`` adds a cast), two
embedded servers (bf16), rollout dtype bf16. In one run: a raw gloo ``broadcast`` of the
same number of bytes to two plain receiver processes (the baseline), then full syncs
(pause -> buckets -> flush -> resume; the fastest of 3 after a warm-up) for bucket sizes
32 MB ... 1 GB, flattened and per tensor, with the time split and the most memory the
sync held at once, in buckets (the overlap's price: bucket k+1 is packed while bucket k is
on the wire, so at most two where a sync without overlap holds one). The cost model of
``areal_mcore/weight_sync/projection.py`` is calibrated with numbers measured here
(link bandwidth, per-message latency, HTTP round trip, copy bandwidth), compared with
every measured sync, then used for the 1.5B/7B/32B x 16/128/1024-GPU projection.
Run: ``python bench/weight_sync.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_mcore.net import free_port
from areal_mcore.rollout.config import ServerConfig
from areal_mcore.rollout.embedded.server import join_group
from areal_mcore.rollout.fleet import Fleet
from areal_mcore.rollout.servers import launch_servers
from areal_mcore.weight_sync import weight_syncer
from areal_mcore.weight_sync.buckets import DTYPES
from areal_mcore.weight_sync.config import WeightSyncConfig
from areal_mcore.weight_sync.group import init_update_group
from areal_mcore.weight_sync.projection import GPU_LINK, LinkModel, predict_sync_s, projection_table

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
MB = 2**20


def hf_config(small: bool):
    from transformers import Qwen2Config

    if small:  # the smoke-test size
        return Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)


def _receiver(rank, port, numel, n_small, world):
    os.environ["OMP_NUM_THREADS"] = "1"
    group = join_group(master_address="127.0.0.1", master_port=port, rank=rank + 1,
                       world_size=world, group_name="raw", backend="gloo")
    small = torch.empty(1, dtype=torch.bfloat16)
    for _ in range(n_small):
        group.broadcast(small, 0).wait()
    big = torch.empty(numel, dtype=torch.bfloat16)
    for _ in range(3):
        group.broadcast(big, 0).wait()


def raw_broadcast(nbytes: int, receivers: int, n_small: int = 200) -> tuple[float, float]:
    """(seconds of the best of 3 raw broadcasts of ``nbytes``, per-message latency)."""
    port, numel = free_port(), nbytes // 2
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(r, port, numel, n_small, receivers + 1))
             for r in range(receivers)]
    for p in procs:
        p.start()
    group = init_update_group(master_address="127.0.0.1", master_port=port,
                              world_size=receivers + 1, group_name="raw", backend="gloo")
    small = torch.zeros(1, dtype=torch.bfloat16)
    t = time.perf_counter()
    for _ in range(n_small):
        group.broadcast(small, 0).wait()
    alpha = (time.perf_counter() - t) / n_small
    big = torch.ones(numel, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        group.broadcast(big, 0).wait()
        best = min(best, time.perf_counter() - t)
    for p in procs:
        p.join()
    return best, alpha


def copy_GBps(nbytes: int, src_dtype: torch.dtype) -> float:
    """Bytes written per second by a copy into bf16 (from bf16: a load; from fp32: a cast)."""
    src = torch.ones(nbytes // 2, dtype=src_dtype)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t) / 1e9


async def http_rtt(addresses: list[str], n: int = 20) -> float:
    """One control call to every server (a cache flush), as the sync makes them."""
    async with Fleet(addresses) as fleet:
        await fleet.all("POST", "/flush_cache")
        t = time.perf_counter()
        for _ in range(n):
            await fleet.all("POST", "/flush_cache")
        return (time.perf_counter() - t) / n


async def one_config(actor, addresses, bucket_mb: float, flatten: bool, repeats: int = 3):
    """The fastest of ``repeats`` pushes (after a warm-up: allocations, connections), the
    plan, and the most memory the sync held at once beyond the actor's: its two bucket
    buffers plus the payload tensors of its own (neither a parameter's nor a buffer's
    memory: q/k/v cut out of a fused weight, TP-gathered tensors) of two consecutive
    buckets, bucket k on the wire while bucket k+1 is packed."""
    cfg = WeightSyncConfig(bucket_mb=bucket_mb, flatten=flatten, dtype="bfloat16",
                           master_address="127.0.0.1")
    syncer = weight_syncer(cfg, actor, addresses)
    params = {p.untyped_storage().data_ptr() for p in actor.model.module.parameters()}
    owned: list[list[int]] = []  # per push, per bucket
    gather = syncer._gather

    def counting_gather(plan, i, stats):
        payload = gather(plan, i, stats)
        shared = params | {t.untyped_storage().data_ptr() for b in syncer._buffers for t in b._bufs.values()}
        fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in payload
                 if t.untyped_storage().data_ptr() not in shared}
        owned[-1].append(sum(fresh.values()))
        return payload
    syncer._gather = counting_gather
    await syncer.connect()
    runs = []
    for version in range(1 + repeats):
        owned.append([])
        runs.append(await syncer.push(version + 1))
    runs = runs[1:]
    await syncer.close()
    if any(r.failures for r in runs):
        raise RuntimeError([r.failures for r in runs])
    buffers = sum(t.untyped_storage().nbytes() for b in syncer._buffers for t in b._bufs.values())
    in_flight = max(a + b for push in owned for a, b in zip(push, push[1:] + [0]))
    return min(runs, key=lambda r: r.total_s), syncer.plan(), buffers + in_flight


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--buckets", default="32,64,256,1024", help="bucket sizes in MB")
    # The boba recipes train in bf16 (configs/boba_*.yaml actor.dtype): the sync copies
    # bf16 parameters into bf16 buckets. fp32 adds a cast to every copy.
    ap.add_argument("--actor-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON results go ('' for nowhere)")
    a = ap.parse_args(argv)
    buckets = [float(b) for b in a.buckets.split(",")]

    from transformers import Qwen2ForCausalLM

    from areal_mcore.actor.config import ActorConfig, MicroBatchSpec, OptimizerConfig
    from areal_mcore.actor.megatron_actor import MegatronActor

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    config = hf_config(a.small)
    actor = MegatronActor(ActorConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=1024), dtype=a.actor_dtype,
                                      optimizer=OptimizerConfig(lr=1e-5)), config)
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(1)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(os.path.join(root, "hf"))
        servers = launch_servers(ServerConfig(model_path=os.path.join(root, "hf"), n_servers=2,
                                              dtype="bfloat16", context_length=1024,
                                              log_dir=os.path.join(root, "logs")),
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})  # 2 cores, 3 processes
        addresses = [s.address for s in servers]
        try:
            rows = []
            for bucket_mb in buckets:
                for flatten in (True, False):
                    stats, plan, held = asyncio.run(one_config(actor, addresses, bucket_mb, flatten))
                    largest = max(sum(u.nbytes(DTYPES[plan.dtype]) for u in b) for b in plan.buckets)
                    rows.append({"bucket_mb": bucket_mb, "flatten": flatten, "buckets": stats.buckets,
                                 "held_buckets": held / largest,
                                 "tensors": sum(len(u.hf) for b in plan.buckets for u in b),
                                 "bytes": stats.bytes, "total_s": stats.total_s, "gather_s": stats.gather_s,
                                 "convert_s": stats.convert_s, "http_s": stats.http_s, "wire_s": stats.wire_s})
            nbytes = rows[0]["bytes"]
            rtt = asyncio.run(http_rtt(addresses))
        finally:
            for s in servers:
                s.stop()
    raw_s, alpha = raw_broadcast(nbytes, receivers=2)
    raw_GBps = nbytes / raw_s / 1e9
    cpu = LinkModel(link_GBps=raw_GBps, alpha_s=alpha / 2, rtt_s=rtt,
                    load_GBps=copy_GBps(nbytes, torch.bfloat16), gather_GBps=1e9,  # TP=1: no gather
                    convert_GBps=copy_GBps(nbytes, torch.float32))
    for r in rows:
        r["GBps"] = r["bytes"] / r["total_s"] / 1e9
        r["ratio_to_raw"] = r["GBps"] / raw_GBps
        r["predicted_s"] = predict_sync_s(r["bytes"], receivers=2, bucket_bytes=r["bucket_mb"] * MB,
                                          tensors=r["tensors"], flatten=r["flatten"], tp=1, link=cpu)["total_s"]
        r["error"] = r["predicted_s"] / r["total_s"] - 1

    print(f"payload {nbytes / 1e6:.0f} MB bf16 to 2 embedded servers; raw gloo broadcast "
          f"{raw_GBps:.2f} GB/s ({raw_s * 1e3:.0f} ms), per-message latency {alpha * 1e6:.0f} us, "
          f"HTTP round trip {rtt * 1e3:.1f} ms, copy {cpu.load_GBps:.1f} GB/s, "
          f"fp32->bf16 cast {cpu.convert_GBps:.1f} GB/s")
    print(f"{'bucket MB':>9} {'flat':>5} {'#b':>4} {'total ms':>9} {'GB/s':>6} {'/raw':>5} "
          f"{'gather':>7} {'convert':>8} {'http':>7} {'wire':>7} {'model ms':>9} {'err':>6} {'held/bucket':>11}")
    for r in rows:
        print(f"{r['bucket_mb']:>9g} {('yes' if r['flatten'] else 'no'):>5} {r['buckets']:>4} "
              f"{r['total_s'] * 1e3:>9.0f} {r['GBps']:>6.2f} {r['ratio_to_raw']:>5.2f} "
              f"{r['gather_s'] * 1e3:>7.0f} {r['convert_s'] * 1e3:>8.0f} {r['http_s'] * 1e3:>7.0f} "
              f"{r['wire_s'] * 1e3:>7.0f} {r['predicted_s'] * 1e3:>9.0f} {r['error']:>+6.0%} "
              f"{r['held_buckets']:>11.2f}")
    best = max(rows, key=lambda r: r["ratio_to_raw"])
    print(f"best: {best['bucket_mb']:g} MB {'flattened' if best['flatten'] else 'per tensor'}: "
          f"{best['ratio_to_raw']:.2f}x raw broadcast, holding at most {best['held_buckets']:.2f}x its largest "
          f"bucket (a sync without overlap: 1); model error "
          f"{min(r['error'] for r in rows):+.0%} .. {max(r['error'] for r in rows):+.0%}")

    table = projection_table(GPU_LINK)
    print("\nprojection, 400 Gb/s GDRDMA, NCCL ring, 1 GB flattened buckets (3/4 of GPUs serve):")
    print(f"{'model':>6} {'GPUs':>5} {'receivers':>9} {'total s':>8} {'wire s':>7} {'http s':>7}")
    for t in table:
        print(f"{t['model']:>6} {t['gpus']:>5} {t['receivers']:>9} {t['total_s']:>8.2f} "
              f"{t['wire_s']:>7.2f} {t['http_s']:>7.3f}")
    result = {"raw_GBps": raw_GBps, "alpha_s": alpha, "rtt_s": rtt, "rows": rows, "projection": table}
    if a.out:
        Path(a.out).parent.mkdir(exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
