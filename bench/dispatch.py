"""Rollout dispatch on CPU/gloo: per-replica packed tensors vs the pickled whole-batch broadcast.

In one run, for DP 2 and 4 (one gloo rank per replica): rank 0 builds a seeded batch of
``rollout.trajectory.Sample``s (Python lists, as the client returns them), then

* baseline: ``broadcast_object_list`` of the whole batch to every rank (what PPORun did
  before #16); each rank then takes its groups;
* dispatch: ``Dispatcher.dispatch`` (trainer/dispatch.py): each replica's groups packed into
  one byte buffer and sent once to it, (a) converting the lists at dispatch time and (b)
  with a ``SamplePacker`` that converted each group as it arrived (what PPORun does: the
  controller's ``on_group`` runs while other groups still generate; its time is printed
  as "on arrival" and is not on the dispatch path).

Both on the same batch, in the same processes. Printed: bytes and seconds per step on
rank 0 and on the slowest receiver, the ratio of rank 0's dispatch cost to the pickled
broadcast's, and the 1K-GPU projection of trainer/dispatch_projection.py with constants
measured here (ns per element to convert and to pickle/unpickle, concatenation GB/s).
Shapes: the tiny run's (2 prompts x 4 samples, <= 16 new tokens) and boba's (groups of
16, prompts 100-1024 tokens, lognormal responses capped at 27,648; 8192 samples is a
60M-token step). ``--samples`` scales the boba batch (default 2048, a quarter step, so
that four ranks fit in memory next to other jobs); the projection uses the full 8192.
Run: ``python bench/dispatch.py`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_mcore.net import free_port
from areal_mcore.rollout.trajectory import Sample
from areal_mcore.trainer.dispatch import Dispatcher, SamplePacker, split_groups
from areal_mcore.trainer.dispatch_projection import (
    BatchShape,
    DispatchLink,
    predict_dispatch_s,
    predict_pickled_s,
)

GROUP = 16
# Constants of an unloaded machine, for the second projection (this bench's own are
# inflated when the machine is oversubscribed): list conversion 25 ns/element (measured
# here when idle: np.array of int lists 27, of floats 22), pickle 32 and unpickle 49
# ns/element (issue #16: 0.86 GB, 5.5 s / 8.4 s for a 60M-token batch), and 5 GB/s for a
# host memcpy (an assumption for a server CPU, not measured here).
REFERENCE = {"t_elem_ns": 25.0, "t_pickle_ns": 32.0, "t_unpickle_ns": 49.0, "concat_GBps": 5.0}


def boba_batch(samples: int, seed: int = 0, group: int = GROUP) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(samples // group):
        prompt = rng.integers(0, 151_000, int(rng.integers(100, 1025))).tolist()
        lens = np.minimum(rng.lognormal(8.6, 0.9, group).astype(int) + 1, 27_648)
        for n in lens:
            out.append(Sample(group=g, prompt_ids=prompt, output_ids=rng.integers(0, 151_000, n).tolist(),
                              logprobs=(-rng.random(n)).tolist(), versions=[7] * int(n), reward=float(n % 2),
                              finish_reason="stop", start_version=7))
    return out


def tiny_batch() -> list[Sample]:
    rng = np.random.default_rng(1)
    return [Sample(group=i // 4, prompt_ids=rng.integers(0, 512, 30).tolist(),
                   output_ids=rng.integers(0, 512, 16).tolist(), logprobs=(-rng.random(16)).tolist(),
                   versions=[1] * 16, reward=0.0, finish_reason="length", start_version=1) for i in range(8)]


def _rank(rank, world, port, shape, samples_n, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = dist.group.WORLD
    samples = (tiny_batch() if shape == "tiny" else boba_batch(samples_n)) if rank == 0 else None
    group = 4 if shape == "tiny" else GROUP
    d = Dispatcher(dp_rank=rank, dp_size=world, mp_group=None, world=g, control=g)
    out = {}
    for _ in range(2):  # the second round is reported (first touches of buffers excluded)
        dist.barrier()
        t = time.perf_counter()
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        mine = split_groups(box[0], group, world)[rank]
        out["pickled_s"] = time.perf_counter() - t
        del box, mine
        dist.barrier()
        t = time.perf_counter()
        shard, st = d.dispatch(samples, group)
        out["dispatch_s"] = time.perf_counter() - t
        out.update(pack_s=st.pack_s, send_s=st.send_s, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                   shard_samples=shard.num_samples)
        packer = None
        if rank == 0:
            packer = SamplePacker()
            t = time.perf_counter()
            for i in range(0, len(samples), group):
                packer(samples[i:i + group])
            out["on_arrival_s"] = time.perf_counter() - t
        dist.barrier()
        t = time.perf_counter()
        shard2, st = d.dispatch(samples, group, packer)
        out["dispatch_arrays_s"] = time.perf_counter() - t
        out.update(pack_arrays_s=st.pack_s, same_shard=bool(torch.equal(shard2.tokens, shard.tokens)
                                                             and torch.equal(shard2.logprobs, shard.logprobs)))
        del packer
    if rank == 0:
        t = time.perf_counter()
        blob = pickle.dumps(samples)
        out["pickle_s"] = time.perf_counter() - t
        t = time.perf_counter()
        pickle.loads(blob)
        out["unpickle_s"] = time.perf_counter() - t
        out["pickled_bytes"] = len(blob)
        out["tokens"] = sum(len(s.prompt_ids) + len(s.output_ids) for s in samples)
        out["response_tokens"] = sum(len(s.output_ids) for s in samples)
        out["samples"] = len(samples)
        out["concat_s"] = out["pack_arrays_s"]  # the pack when samples arrived as arrays
        out["concat_bytes"] = 2 * out["bytes_sent"] * world / max(world - 1, 1)  # two copies (the model's form)
    dist.destroy_process_group()
    queue.put((rank, out))


def measure(shape: str, world: int, samples_n: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, shape, samples_n, queue)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return [res[r] for r in range(world)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2048, help="boba-shaped samples measured (8192 = one step)")
    p.add_argument("--out", default="bench/results/dispatch.json")
    a = p.parse_args(argv)
    rows = []
    for shape in ("tiny", "boba"):
        for world in (2, 4):
            ranks = measure(shape, world, a.samples)
            r0 = ranks[0]
            row = {"shape": shape, "dp": world, "samples": r0["samples"], "tokens": r0["tokens"],
                   "pickled_bytes_to_each_rank": r0["pickled_bytes"], "dispatch_bytes_sent": r0["bytes_sent"],
                   "rank0_pickled_s": r0["pickled_s"], "rank0_dispatch_s": r0["dispatch_s"],
                   "rank0_pack_s": r0["pack_s"], "rank0_send_s": r0["send_s"],
                   "slowest_pickled_s": max(r["pickled_s"] for r in ranks),
                   "slowest_dispatch_s": max(r["dispatch_s"] for r in ranks),
                   "ratio_rank0": r0["dispatch_s"] / r0["pickled_s"],
                   "rank0_dispatch_arrays_s": r0["dispatch_arrays_s"], "rank0_on_arrival_s": r0["on_arrival_s"],
                   "ratio_rank0_arrays": r0["dispatch_arrays_s"] / r0["pickled_s"],
                   "slowest_dispatch_arrays_s": max(r["dispatch_arrays_s"] for r in ranks),
                   "same_shard": all(r["same_shard"] for r in ranks),
                   "ratio_rank0_wire_only": r0["send_s"] / r0["pickled_s"],
                   "received_samples": [r["shard_samples"] for r in ranks],
                   "pickle_s": r0["pickle_s"], "unpickle_s": r0["unpickle_s"], "concat_s": r0["concat_s"],
                   "concat_bytes": r0["concat_bytes"], "response_tokens": r0["response_tokens"]}
            rows.append(row)
            print(f"{shape:>4} DP{world}: {row['samples']} samples, {row['tokens'] / 1e6:.3f}M tokens | pickled "
                  f"{row['pickled_bytes_to_each_rank'] / 1e6:.1f} MB to each of {world - 1} ranks: rank 0 "
                  f"{row['rank0_pickled_s']:.3f} s, slowest {row['slowest_pickled_s']:.3f} s | dispatch "
                  f"{row['dispatch_bytes_sent'] / 1e6:.1f} MB sent: rank 0 {row['rank0_dispatch_s']:.3f} s (pack "
                  f"{row['rank0_pack_s']:.3f} + send {row['rank0_send_s']:.3f}), slowest "
                  f"{row['slowest_dispatch_s']:.3f} s | rank 0 ratio {row['ratio_rank0']:.2f} (wire only "
                  f"{row['ratio_rank0_wire_only']:.3f}) | packed on arrival ({row['rank0_on_arrival_s']:.3f} s, off "
                  f"the path): rank 0 {row['rank0_dispatch_arrays_s']:.3f} s, slowest "
                  f"{row['slowest_dispatch_arrays_s']:.3f} s, ratio {row['ratio_rank0_arrays']:.3f}", flush=True)
    boba = [r for r in rows if r["shape"] == "boba"][-1]
    elems = boba["tokens"] + 2 * boba["response_tokens"]
    t_elem = boba["rank0_pack_s"] / elems
    t_pickle, t_unpickle = boba["pickle_s"] / elems, boba["unpickle_s"] / elems
    concat_GBps = boba["concat_bytes"] / boba["concat_s"] / 1e9
    full = BatchShape(samples=8192, tokens=int(boba["tokens"] * 8192 / boba["samples"]),
                      response_tokens=int(boba["response_tokens"] * 8192 / boba["samples"]))
    pickled_full = boba["pickled_bytes_to_each_rank"] * 8192 / boba["samples"]
    link = DispatchLink()
    print(f"\nmeasured: pack {t_elem * 1e9:.1f} ns/element from lists, pickle {t_pickle * 1e9:.1f}, unpickle "
          f"{t_unpickle * 1e9:.1f} ns/element, concatenation of arrays {concat_GBps:.2f} GB/s")
    print(f"projection, boba step of 8192 samples ({full.tokens / 1e6:.1f}M tokens, {full.wire_bytes / 1e9:.2f} GB "
          f"packed, {pickled_full / 1e9:.2f} GB pickled), 1024 GPUs = 512 rollout + 512 trainer, "
          f"{link.link_GBps:g} GB/s link:")
    print(f"{'constants':>10} {'trainer layout':>14} {'D':>4} {'pickled s':>10} {'dispatch s, lists':>18} "
          f"{'dispatch s, arrays':>19}")
    projections = []
    consts = {"measured": (t_elem, t_pickle, t_unpickle, concat_GBps),
              "reference": (REFERENCE["t_elem_ns"] * 1e-9, REFERENCE["t_pickle_ns"] * 1e-9,
                            REFERENCE["t_unpickle_ns"] * 1e-9, REFERENCE["concat_GBps"])}
    for label, (te, tp, tu, cg) in consts.items():
        for name, d, m in (("7B d64 t8", 64, 8), ("7B d128 t4", 128, 4), ("32B d16 p4t8", 16, 32)):
            pk = predict_pickled_s(full, world=512, pickled_bytes=pickled_full, t_pickle_s=tp, t_unpickle_s=tu,
                                   link=link)
            lists = predict_dispatch_s(full, replicas=d, mp_size=m, t_elem_s=te, link=link)
            arrays = predict_dispatch_s(full, replicas=d, mp_size=m, t_elem_s=te, link=link, concat_GBps=cg)
            projections.append({"constants": label, "layout": name, "replicas": d, "mp": m, "pickled": pk,
                                "lists": lists, "arrays": arrays})
            print(f"{label:>10} {name:>14} {d:>4} {pk['total_s']:>10.2f} {lists['total_s']:>18.2f} "
                  f"{arrays['total_s']:>19.2f}")
    result = {"rows": rows, "reference_constants": REFERENCE, "constants": {"t_elem_ns": t_elem * 1e9, "t_pickle_ns": t_pickle * 1e9,
                                          "t_unpickle_ns": t_unpickle * 1e9, "concat_GBps": concat_GBps},
              "projection_1k_gpus": projections}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
