"""Routing replay for MoE: the actor's routers use the experts the rollout engine chose.

Shape legend: T = tokens of a packed micro-batch (padding included), Tl = the tokens this
rank's routers see (T / tp under sequence parallelism, else T), L = the model's layers
(every decoder layer, dense ones included, as the engines return them), Ll = this pipeline
stage's MoE layers, K = top_k.

Built on megatron-core's own mechanism (transformer/moe/router_replay.py, ``RouterReplay``;
0.16.1 and 0.19.2 alike): with ``TransformerConfig.moe_enable_routing_replay`` every
``TopKRouter`` owns a ``RouterReplay`` (router.py, ``TopKRouter.__init__``), and the top-k of
its score function goes through ``RouterReplay.get_replay_topk`` (moe_utils.py,
``topk_softmax_with_capacity`` in 0.16.1, ``topk_routing_with_score_function`` in 0.19.2).
``REPLAY_FORWARD`` takes the target indices and gathers the router's scores at them (so the
gate weights of the replayed experts keep their gradient); ``RECORD`` keeps the router's
own top-k. We address each router's instance directly rather than megatron's class-wide
list (``RouterReplay.global_router_replay_instances``), which also holds the routers of
every other model built in the process (the frozen reference model, earlier actors).

The routing field is the engines' ``routed_experts`` laid per token: row t holds the experts
token t was routed to in each layer (vLLM 0.32 and SGLang 0.5.23 size it by
``num_hidden_layers`` and leave dense layers' entries unset; only MoE layers are read), -1
where the engine returned none (the last token of a sequence: it was sampled, never
forwarded; a sample whose routing was lost). Those rows, and padding, keep the router's own
top-k: megatron replays one index tensor for all tokens, so ``_RecordingReplay`` merges the
two before megatron gathers the scores.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

FIELD = "routed_experts"


class _RecordingReplay(RouterReplay):
    """megatron's ``RouterReplay`` that, while it replays, also records the router's own
    top-k (so the train-vs-rollout disagreement is measured with replay on as well:
    megatron's ``REPLAY_FORWARD`` computes none) and keeps the router's own choice for the
    rows the rollout has no routing for (see ``has_routing``).

    Under full recompute (``recompute``: set for a training forward with
    ``recompute_granularity=full``) the backward reruns each layer's forward, and with
    pp > 1 several micro-batches are in flight (1F1B) when it does, so the current target
    is another micro-batch's. megatron keeps a queue for this (``replay_backward_list``,
    ``REPLAY_BACKWARD``) but nothing switches to it; here the first forward, which megatron's
    ``CheckpointFunction.forward`` runs without grad (tensor_parallel/random.py), queues
    the experts it used and the recomputation (with grad) takes them in order: a stage's
    backwards run in its forwards' order under every megatron schedule."""

    recompute: bool = False
    _queue: list[torch.Tensor]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            if self.recompute and torch.is_grad_enabled():  # the backward's recomputation
                self.target_topk_idx = self._queue.pop(0)
            else:
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self.record_indices(own)
                target = self.target_topk_idx.to(scores.device)
                self.target_topk_idx = torch.where(has_routing(target)[:, None], target, own)
                if self.recompute:
                    self._queue.append(self.target_topk_idx)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    def clear_queue(self) -> None:
        self._queue = []


def has_routing(experts_TK: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows that are a routing, K distinct experts >= 0. Not: -1 (the engine
    returned none: a sequence's last token, a sample without routing) and padding's zeros
    (with K > 1; at K = 1 padding replays expert 0, which only padding's masked outputs see)."""
    s = experts_TK.sort(-1).values
    ok = s[:, 0] >= 0
    if s.shape[-1] > 1:
        ok &= (s[:, 1:] != s[:, :-1]).all(-1)
    return ok


def stage_routers(module: torch.nn.Module) -> list[RouterReplay]:
    """This stage's MoE layers' replay handles, in layer order, each made a recording one
    (once). Empty for a dense model or one built without ``moe_enable_routing_replay``."""
    out = []
    for m in module.modules():
        old = getattr(m, "router_replay", None) if isinstance(m, TopKRouter) else None
        if old is None:
            continue
        if not isinstance(old, _RecordingReplay):
            m.router_replay = _RecordingReplay()  # joins megatron's class-wide list (__init__)
            m.router_replay.clear_queue()
            m.router_replay.layer_number = getattr(old, "layer_number", None)  # 0.19.2 sets it
            RouterReplay.global_router_replay_instances.remove(old)
        out.append(m.router_replay)
    return out


def local_tokens(x_T: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """The rows this TP rank's routers see: under sequence parallelism the MoE layer's input
    is the rank's contiguous 1/tp of the tokens (the router runs before the dispatcher
    gathers them, moe_layer.py ``MoELayer.route``); otherwise all of them."""
    if not sequence_parallel or tp_size == 1:
        return x_T
    n = x_T.shape[0] // tp_size
    return x_T[tp_rank * n:(tp_rank + 1) * n]


def start(routers: list[RouterReplay], experts_TlLlK: torch.Tensor | None, replay: bool,
          recompute: bool = False) -> None:
    """Arms this stage's routers for one forward: replay ``experts`` (when ``replay``) or
    record the routers' own top-k (when there is a rollout routing to compare with).
    ``recompute``: a training forward whose layers the backward recomputes (full)."""
    for i, r in enumerate(routers):
        r.clear_indices()
        r.recompute = recompute
        if experts_TlLlK is not None and replay:
            r.set_target_indices(experts_TlLlK[:, i].long())
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif experts_TlLlK is not None:
            r.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            r.clear_router_replay_action()


def stop(routers: list[RouterReplay]) -> None:
    """Back to the router's own top-k, nothing held."""
    for r in routers:
        r.clear_indices()
        r.clear_queue()
        r.clear_router_replay_action()


def disagreement_counts(routers: list[RouterReplay], experts_TlLlK: torch.Tensor,
                        real_Tl: torch.Tensor) -> torch.Tensor:
    """[differing, compared] (float64, on the device, no host sync): the (token, MoE layer)
    entries whose recorded top-k set differs from the rollout's, over real (not padding)
    tokens whose rollout row holds a routing."""
    out = torch.zeros(2, dtype=torch.float64, device=experts_TlLlK.device)
    for i, r in enumerate(routers):
        own = r.get_recorded_indices()
        if own is None:
            continue
        want = experts_TlLlK[:, i].long()
        has = real_Tl & has_routing(want)
        differs = (own.sort(-1).values != want.sort(-1).values).any(-1)
        out[0] += (differs & has).sum()
        out[1] += has.sum()
    return out
