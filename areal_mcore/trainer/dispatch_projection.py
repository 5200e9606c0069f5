"""A cost model of one step's rollout dispatch (trainer/dispatch.py), to predict it at scale.

One step moves S samples with N_T tokens (prompt + response) and N_O response tokens.
Each element (token id, logprob, version) is 4 bytes, plus 24 bytes of lengths, reward and
truncated flag per sample, so the batch is ``B = 4 N_T + 8 N_O + 24 S`` bytes (MoE routing,
``server.return_routed_experts``, would add 2 x layers x top_k per token, int16: not modelled) over ``D``
replicas (D = trainer GPUs / (tp x pp)); every replica has ``tp x pp = M`` ranks::

    pack    = E * t_elem                 E = N_T + 2 N_O elements, Python lists -> arrays
              (or 2 B / copy_bw when samples hold arrays from arrival: one copy to
              concatenate them, one into the wire buffer)
    h2d     = B / h2d_bw                 NCCL sends from the GPU: the buffer goes up once
    send    = B (D - 1) / D / link_bw + 2 (D - 1) alpha      rank 0 -> each head, in turn
    bcast   = (B / D) / mp_bw + 2 ceil(log2 M) alpha         head -> its TP x PP peers
    total   = pack + h2d + send + bcast  (the last head's data arrives last)

The pickled broadcast it replaces, for comparison, on W ranks (ring, pipelined)::

    pickled = E * t_pickle + P / link_bw + W alpha + E * t_unpickle     P = pickled bytes

(every rank unpickles the whole batch before it can take its share).
``bench/dispatch.py`` measures t_elem, t_pickle, t_unpickle, concat_bw and P here and
prints both projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(kw_only=True)
class DispatchLink:
    link_GBps: float = 25.0  # rank 0's inter-node link (200 Gb/s InfiniBand ~ 25 GB/s)
    mp_GBps: float = 100.0  # inside a replica (NVLink for TP; PP stages may cross nodes)
    h2d_GBps: float = 20.0  # pageable host -> GPU copy
    alpha_s: float = 20e-6  # per message


@dataclass(kw_only=True)
class BatchShape:
    samples: int
    tokens: int  # N_T: prompt + response tokens of all samples
    response_tokens: int  # N_O

    @property
    def elements(self) -> int:
        return self.tokens + 2 * self.response_tokens

    @property
    def wire_bytes(self) -> int:
        return 4 * self.tokens + 8 * self.response_tokens + 24 * self.samples


def predict_dispatch_s(shape: BatchShape, *, replicas: int, mp_size: int, t_elem_s: float,
                       link: DispatchLink, concat_GBps: float | None = None) -> dict[str, float]:
    """Seconds of one per-replica dispatch, and its parts. ``concat_GBps`` set: the
    samples already hold arrays (pack is two host copies at that rate)."""
    b, d = shape.wire_bytes, replicas
    pack = 2 * b / (concat_GBps * GB) if concat_GBps else shape.elements * t_elem_s
    h2d = b / (link.h2d_GBps * GB)
    send = b * (d - 1) / d / (link.link_GBps * GB) + 2 * (d - 1) * link.alpha_s
    bcast = (b / d) / (link.mp_GBps * GB) + 2 * math.ceil(math.log2(mp_size)) * link.alpha_s if mp_size > 1 else 0.0
    return {"pack_s": pack, "h2d_s": h2d, "send_s": send, "bcast_s": bcast, "total_s": pack + h2d + send + bcast}


def predict_pickled_s(shape: BatchShape, *, world: int, pickled_bytes: float, t_pickle_s: float,
                      t_unpickle_s: float, link: DispatchLink) -> dict[str, float]:
    """Seconds of the pickled whole-batch broadcast to ``world`` ranks, and its parts."""
    pickle_s = shape.elements * t_pickle_s
    wire = pickled_bytes / (link.link_GBps * GB) + world * link.alpha_s
    unpickle = shape.elements * t_unpickle_s
    return {"pickle_s": pickle_s, "wire_s": wire, "unpickle_s": unpickle, "total_s": pickle_s + wire + unpickle}
