"""The allocation string: how a job's GPUs split between rollout servers and the trainer.

``sglang:d4t2+megatron:d2p2t4`` = 4 SGLang servers of tensor-parallel size 2 (8 GPUs) and a
megatron trainer with DP 2 x PP 2 x TP 4 (16 GPUs). Letters per side, any order, each at
most once, missing ones = 1: ``d`` data parallel (servers on the rollout side), ``t``
tensor, ``p`` pipeline, ``c`` context parallel (trainer only; ``actor.parallel.cp``, which
config loading requires to agree: each sequence is split over c ranks), ``e`` expert parallel
(trainer only; ``actor.parallel.ep``, which config loading requires to agree). The rollout
backend is ``sglang``, ``vllm`` or ``embedded`` (the CPU server: its "GPUs" are processes).

``e`` takes no GPUs of its own, as in AReaL's allocation mode ("expert parallelism does not
increase world size", https://inclusionai.github.io/AReaL/reference/alloc_mode.html): megatron's MoE
parallel folding lays expert-TP x EP x expert-DP x PP over the same ranks as TP x CP x DP x PP
(parallel_state.initialize_model_parallel: its expert rank generator has no CP dimension).
With expert-TP = TP (actor/parallel.py) the EP group is carved out of the data- and
context-parallel ranks, so ``e`` must divide ``d`` x ``c``: ``megatron:d8t2e4`` is 16 GPUs,
each expert layer split over 4 EP ranks x 2 TP ranks, its optimizer state over d / e = 2
expert-DP ranks.

A trainer-only string (``megatron:d1p4t8``) is for SFT, which needs no servers.

Placement: each side gets whole nodes, or fits inside one node of its own; tensor
parallelism stays inside a node (it needs NVLink bandwidth).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

# rollout.engines.BACKENDS (tests/test_launcher_allocation.py keeps them equal; this leaf
# imports nothing of the rollout side).
ROLLOUT_BACKENDS = ("sglang", "embedded", "vllm")
TRAINERS = ("megatron",)
_SIDE = re.compile(r"([a-z]+):((?:[dtpce]\d+)*)")
_DIM = re.compile(r"([dtpce])(\d+)")


class AllocationError(ValueError):
    """An allocation string that cannot work; the message shows the arithmetic."""


@dataclass(frozen=True)
class Side:
    backend: str
    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1  # expert parallel: carved out of d, no GPUs of its own (module docstring)

    @property
    def gpus(self) -> int:
        return self.d * self.t * self.p * self.c  # not e: the EP ranks are DP ranks

    def formula(self) -> str:
        dims = [(k, getattr(self, k)) for k in "dptc" if k == "d" or getattr(self, k) > 1]
        return " x ".join(f"{k}{v}" for k, v in dims) + f" = {self.gpus} GPUs"

    def __str__(self) -> str:
        return f"{self.backend}:" + "".join(f"{k}{getattr(self, k)}" for k in "dptce" if getattr(self, k) > 1
                                            or k == "d")


@dataclass(frozen=True)
class Allocation:
    rollout: Side | None  # None: trainer only (SFT)
    trainer: Side

    def __str__(self) -> str:
        return f"{self.rollout}+{self.trainer}" if self.rollout else str(self.trainer)

    def place(self, nodes: int, gpus_per_node: int) -> tuple[int, int]:
        """(rollout nodes, trainer nodes) on an allocation of ``nodes`` x ``gpus_per_node``."""
        if nodes < 1 or gpus_per_node < 1:
            raise AllocationError(f"an allocation needs >= 1 node and >= 1 GPU per node, got "
                                  f"{nodes} x {gpus_per_node}")
        need = [0] if self.rollout is None else []
        for side in [s for s in (self.rollout, self.trainer) if s is not None]:
            if side.t > gpus_per_node:
                raise AllocationError(
                    f"{side}: tensor parallel size t{side.t} exceeds the {gpus_per_node} GPUs of a node "
                    f"(tensor parallelism stays inside a node)")
            if side.gpus > gpus_per_node and side.gpus % gpus_per_node:
                raise AllocationError(
                    f"{side}: {side.formula()}, which is neither whole {gpus_per_node}-GPU nodes nor "
                    f"at most one node ({side.gpus} / {gpus_per_node} = {side.gpus / gpus_per_node:.2f} nodes)")
            if side is self.rollout and side.gpus > gpus_per_node and gpus_per_node % side.t:
                per_node = gpus_per_node // side.t
                raise AllocationError(
                    f"{side}: servers of t{side.t} GPUs do not tile a node of {gpus_per_node} GPUs "
                    f"({gpus_per_node} % {side.t} = {gpus_per_node % side.t}): {per_node} server(s) per "
                    f"node on {side.gpus // gpus_per_node} nodes hold {per_node * (side.gpus // gpus_per_node)} "
                    f"of the {side.d} servers")
            need.append(max(1, side.gpus // gpus_per_node))
        if sum(need) != nodes:
            r, t = self.rollout, self.trainer
            rollout = f"rollout {r.formula()} -> {need[0]} node(s), " if r else ""
            raise AllocationError(
                f"{self}: {rollout}trainer {t.formula()} -> {need[1]} node(s) of {gpus_per_node} GPUs: "
                + (f"{need[0]} + {need[1]} = " if r else "") + f"{sum(need)} nodes, but the allocation has {nodes}")
        return need[0], need[1]


def parse_allocation(text: str) -> Allocation:
    """``<rollout>:<dims>+megatron:<dims>`` (or ``megatron:<dims>``) -> Allocation; errors
    name the bad part."""
    parts = text.strip().split("+")
    if len(parts) == 1 and parts[0].strip().startswith(TRAINERS):
        trainer = _side(parts[0], text)
        _check_trainer(trainer, text)
        return Allocation(None, trainer)
    if len(parts) != 2:
        raise AllocationError(f"allocation {text!r} must be '<rollout>:<dims>+megatron:<dims>', "
                              f"e.g. 'sglang:d4t2+megatron:d2p2t4', or 'megatron:<dims>' for SFT "
                              f"({len(parts)} part(s) found)")
    rollout, trainer = (_side(p, text) for p in parts)
    if rollout.backend not in ROLLOUT_BACKENDS:
        raise AllocationError(f"allocation {text!r}: rollout backend {rollout.backend!r} is not one of "
                              f"{list(ROLLOUT_BACKENDS)} (the rollout side comes first)")
    if trainer.backend not in TRAINERS:
        raise AllocationError(f"allocation {text!r}: trainer {trainer.backend!r} is not one of {list(TRAINERS)}")
    if rollout.c > 1:
        raise AllocationError(f"allocation {text!r}: context parallelism (c) is a trainer dimension")
    if rollout.e > 1:
        # The launcher starts each server with server.tp_size only: nothing would pass an
        # expert-parallel size to SGLang/vLLM, so e would be silently dropped.
        raise AllocationError(f"allocation {text!r}: expert parallelism (e{rollout.e}) is a trainer "
                              f"dimension; the rollout servers are launched with tensor parallelism only "
                              f"(use {dataclasses.replace(rollout, e=1)})")
    if rollout.p > 1:
        # The launcher starts each server with server.tp_size only, on one node: a p2t4
        # server would hold 8 GPUs and use 4, and a server wider than a node needs SGLang's
        # --nnodes/--dist-init-addr, which nothing here passes.
        raise AllocationError(f"allocation {text!r}: pipeline-parallel rollout servers (p{rollout.p}) "
                              f"are not supported (each server is launched with tensor parallelism "
                              f"only, inside one node); use t and d, e.g. "
                              f"{Side(rollout.backend, d=rollout.d * rollout.p, t=rollout.t)}")
    _check_trainer(trainer, text)
    return Allocation(rollout, trainer)


def _check_trainer(trainer: Side, text: str) -> None:
    if (trainer.d * trainer.c) % trainer.e:
        # Megatron builds the EP groups inside the data- and context-parallel ranks
        # (expert-TP = TP here): its expert rank generator needs expert-TP x EP x PP to
        # divide the world (parallel_state.initialize_model_parallel), i.e. e divides d x c.
        fix = dataclasses.replace(trainer, e=math.gcd(trainer.d * trainer.c, trainer.e))
        size, ranks = (f"d{trainer.d}", "DP") if trainer.c == 1 else (f"d{trainer.d} x c{trainer.c}", "DP x CP")
        raise AllocationError(
            f"allocation {text!r}: expert parallelism e{trainer.e} must divide the data-parallel size {size} "
            f"(the EP ranks are carved out of the {ranks} ranks; e adds no GPUs), e.g. {fix}")


def _side(part: str, text: str) -> Side:
    m = _SIDE.fullmatch(part.strip())
    if not m:
        raise AllocationError(f"allocation {text!r}: {part!r} is not '<name>:<dims>' with dims like d4t2 "
                              f"(letters d, t, p, c, e, each followed by a number)")
    dims: dict[str, int] = {}
    for key, value in _DIM.findall(m.group(2)):
        if key in dims:
            raise AllocationError(f"allocation {text!r}: {part!r} gives {key!r} twice")
        if int(value) < 1:
            raise AllocationError(f"allocation {text!r}: {part!r} has {key}{value}; sizes are >= 1")
        dims[key] = int(value)
    return Side(m.group(1), **dims)
