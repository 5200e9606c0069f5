"""A cost model of one weight sync, to size buckets and predict time at scale.

One sync moves ``B`` bytes (the model in the rollout dtype) from the trainer to ``P``
receivers (every TP rank of every server gets the full HF tensors). Stages take turns,
so the bytes add up over stages. With ``n_b`` buckets and ``n_m`` broadcast messages
(one per bucket when flattened, one per tensor otherwise)::

    wire    = B / bw_eff + n_m * hops * alpha         ring: bw_eff = link, hops = P - 1
                                                      tree: bw_eff = link / 2, hops = log2 P
    load    = B / load_bw if flattened, else 0        receiver unpacks into its params
                                                      (per-tensor messages land in place)
    http    = n_b * rtt                               one request per bucket and server
    prepare = B * (tp - 1) / tp / gather_bw + B / convert_bw    TP gather, cast + pack
    total   = prepare / n_b + max(wire + load + http, prepare) + 5 * rtt

The first bucket's preparation is exposed, later ones overlap the wire; 5 round trips
are pause, begin, flush, end and continue.

NCCL broadcasts along rings (pipelined in chunks, so bandwidth does not fall with P but
every message pays a hop latency per rank); the tree row shows what a pipelined binary
tree would cost. Parameters come from ``LinkModel``; ``bench/weight_sync.py`` calibrates
the CPU/gloo form against measured syncs and prints the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(kw_only=True)
class LinkModel:
    link_GBps: float  # per-receiver link bandwidth (400 Gb/s GPU-Direct RDMA = 50 GB/s)
    alpha_s: float  # per-message, per-hop latency
    rtt_s: float  # one HTTP request to a server and back
    load_GBps: float  # receiver-side copy into the model's parameters
    gather_GBps: float  # TP all-gather bandwidth on the trainer (NVLink)
    convert_GBps: float  # trainer-side cast to the rollout dtype + packing (bytes out)
    algo: str = "ring"

    def __post_init__(self):
        if self.algo not in ("ring", "tree"):
            raise ValueError(f"algo must be ring or tree, got {self.algo!r}")


def predict_sync_s(model_bytes: float, *, receivers: int, bucket_bytes: float, tensors: int,
                   flatten: bool, tp: int, link: LinkModel) -> dict[str, float]:
    """Predicted seconds of one sync, and its parts."""
    n_b = max(1, math.ceil(model_bytes / bucket_bytes))
    n_m = n_b if flatten else max(tensors, n_b)
    p = receivers + 1
    if link.algo == "ring":
        bw, hops = link.link_GBps * GB, p - 1
    else:
        bw, hops = link.link_GBps * GB / 2, math.ceil(math.log2(p))
    wire = model_bytes / bw + n_m * hops * link.alpha_s
    load = model_bytes / (link.load_GBps * GB) if flatten else 0.0
    http = n_b * link.rtt_s
    prepare = (model_bytes * (tp - 1) / tp / (link.gather_GBps * GB)
               + model_bytes / (link.convert_GBps * GB))
    total = prepare / n_b + max(wire + load + http, prepare) + 5 * link.rtt_s
    return {"total_s": total, "wire_s": wire, "load_s": load, "http_s": http, "prepare_s": prepare}


# Qwen2.5 sizes (parameters, tensors in HF layout) and a boba-like GPU split: 3/4 of the
# GPUs serve rollout, the actor trains on the rest with the TP below.
MODELS = {"1.5B": (1.54e9, 338, 1, 1), "7B": (7.62e9, 339, 1, 4), "32B": (32.8e9, 771, 4, 8)}
# name: (params, HF tensors, server TP, trainer TP)


def projection_table(link: LinkModel, *, gpus=(16, 128, 1024), bucket_bytes: float = 1 * GB,
                     bytes_per_param: int = 2) -> list[dict]:
    rows = []
    for name, (params, tensors, _server_tp, train_tp) in MODELS.items():
        for n in gpus:
            receivers = n * 3 // 4  # every server TP rank receives the full tensors
            pred = predict_sync_s(params * bytes_per_param, receivers=receivers,
                                  bucket_bytes=bucket_bytes, tensors=tensors, flatten=True,
                                  tp=train_tp, link=link)
            rows.append({"model": name, "gpus": n, "receivers": receivers, **pred})
    return rows


# 400 Gb/s GPU-Direct RDMA per GPU; NCCL hop latency ~5 us inter-node; NVLink all-gather;
# casts and copies at HBM speed.
GPU_LINK = LinkModel(link_GBps=50.0, alpha_s=5e-6, rtt_s=2e-3, load_GBps=1000.0, gather_GBps=300.0,
                     convert_GBps=1000.0)
