"""The seam between what every engine shares and one inference engine.

The client (``rollout/client.py``: load balancing, failover, wire rids, resubmission of
aborted completions, per-token versions) and the weight syncer (``weight_sync/``:
buckets, groups, stage turns, failure handling) are one piece each; everything that
differs between engines sits behind ``Engine`` and its ``WeightUpdater``: the launch command,
the generate request and its response, pause/resume/abort, weight versions and the
weight-update protocol. A new engine is a new module here, never a branch elsewhere.

``fleet`` below is a ``rollout.fleet.Fleet``: engines send through its ``request`` (one
server) and ``all`` (every server, every failure reported) and read its ``servers``; they
never import the client or the syncer. The weight syncer drives an engine's
``WeightUpdater``, which ``Engine.updater(fleet)`` hands it.
"""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from areal_mcore.rollout.protocol import SamplingParams

if TYPE_CHECKING:
    from areal_mcore.rollout.config import ServerConfig
    from areal_mcore.rollout.fleet import Fleet, Server


@dataclass
class Chunk:
    """What one generate attempt returned, in our terms."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]  # the weight version of each output token
    finish_reason: dict  # {"type": "stop"|"length"|"abort", ...} (SGLang's shape)
    # MoE routing of the attempt's input + output tokens but the last output one:
    # [tokens - 1, num_hidden_layers, top_k] int, flat from SGLang (None: not asked for, or
    # not returned)
    routed_experts: np.ndarray | None = None


@dataclass(kw_only=True)
class GroupSpec:
    """One weight-update group: the trainer (rank 0, the store's host) and every
    server's ranks from ``rank_offset`` on."""

    master_address: str
    master_port: int
    group_name: str
    backend: str  # gloo | nccl
    stage: int = 0  # the pipeline stage whose head sends on this group
    rank_offsets: list[int] = field(default_factory=list)  # per server, filled by the engine
    world_size: int = 0


class Engine:
    """One inference engine's protocol. Stateless: per-server state lives in the fleet."""

    name = "base"

    # ---- launch ------------------------------------------------------------------------
    def command(self, cfg: ServerConfig, *, port: int, seed: int) -> list[str]:
        raise NotImplementedError

    def env(self, cfg: ServerConfig, base: dict[str, str]) -> dict[str, str]:
        """The environment one server starts with (``base``: the launcher's)."""
        return base

    # ---- generation --------------------------------------------------------------------
    async def detect(self, fleet: Fleet, s: Server) -> None:
        """Fills the server's version and parallel sizes."""
        raise NotImplementedError

    async def detect_all(self, fleet: Fleet) -> None:
        await asyncio.gather(*[self.detect(fleet, s) for s in fleet.servers])

    def generate_request(self, s: Server, input_ids: list[int], params: SamplingParams,
                         wire_rid: str, *, routed_experts: bool = False) -> tuple[str, dict]:
        """(path, JSON body) of one generate attempt; ``routed_experts``: ask for the MoE
        routing (from a server started with ``server.return_routed_experts``)."""
        raise NotImplementedError

    def parse_generate(self, s: Server, out: dict, requested: int) -> Chunk:
        raise NotImplementedError

    def dead_engine(self, status: int, text: str) -> bool:
        """True when an HTTP error means the engine behind the server is gone for good
        (the client then marks the server unhealthy and fails the request over)."""
        return False

    # ---- control -----------------------------------------------------------------------
    async def abort(self, fleet: Fleet, s: Server, wire_rid: str) -> None:
        raise NotImplementedError

    async def abort_all(self, fleet: Fleet) -> None:
        raise NotImplementedError

    async def pause(self, fleet: Fleet, mode: str) -> None:
        raise NotImplementedError

    async def resume(self, fleet: Fleet) -> None:
        raise NotImplementedError

    async def flush_cache(self, fleet: Fleet) -> None:
        raise NotImplementedError

    async def weight_versions(self, fleet: Fleet) -> list[str]:
        raise NotImplementedError

    # ---- weight updates ----------------------------------------------------------------
    updater_class: type[WeightUpdater]

    def updater(self, fleet: Fleet) -> WeightUpdater:
        """The weight-update protocol on ``fleet``: what the weight syncer drives."""
        return self.updater_class(self, fleet)


class WeightUpdater:
    """One engine's weight-update protocol on one fleet (``weight_sync/``): the group a
    stage sends on, the update session, a bucket's receive, the new version. The syncer
    sees the servers through this and nothing else."""

    def __init__(self, engine: Engine, fleet: Fleet):
        self.engine, self.fleet = engine, fleet

    def check_distributed(self, pp_size: int) -> None:
        """Raises ``RolloutError`` for servers this engine cannot update over a group."""

    def transport(self, backend: str) -> str:
        """What the trainer's end of the group is (``weight_sync/transport.py``)."""
        return "torch"

    def flattened(self, backend: str) -> bool:
        """Whether a bucket may travel as one flat ``uint8`` broadcast."""
        return True

    def group_spec(self, *, master_address: str, master_port: int, group_name: str,
                   backend: str, stage: int = 0) -> GroupSpec:
        """The group of one stage: trainer rank 0, each server's receiving ranks after it."""
        offsets, off = [], 1
        for s in self.fleet.servers:
            offsets.append(off)
            off += s.tp_size
        return GroupSpec(master_address=master_address, master_port=master_port,
                         group_name=group_name, backend=backend, stage=stage,
                         rank_offsets=offsets, world_size=off)

    async def init_group(self, spec: GroupSpec) -> None:
        """Blocks until every server joined; the trainer joins as rank 0 concurrently."""
        raise NotImplementedError

    async def destroy_group(self, spec: GroupSpec) -> None:
        raise NotImplementedError

    async def begin(self, pause_mode: str) -> None:
        """Pauses generation and opens an update session."""
        raise NotImplementedError

    async def receive_bucket(self, *, names: list[str], dtypes: list[str],
                             shapes: list[list[int]], group: GroupSpec, flatten: bool,
                             weight_version: str | None) -> None:
        """Every server of the group receives one bucket by ``broadcast(src=0)`` while the
        trainer sends it; answers once they loaded it."""
        raise NotImplementedError

    async def finish(self, pause_mode: str, version: str) -> None:
        """Closes the session, makes the servers report ``version`` and resumes."""
        raise NotImplementedError

    async def end(self, *, best_effort: bool) -> None:
        """Closes an open session (best effort: ignoring refusals, on every server)."""
        raise NotImplementedError

    async def from_disk(self, path: str, version: str, pause_mode: str) -> None:
        """Loads an HF export, paused around it."""
        raise NotImplementedError


def decode_npy_b64(text: str) -> np.ndarray:
    """vLLM's encoding of ``routed_experts``: base64 of ``np.save``'s .npy bytes
    (vllm/utils/serial_utils.py ``numpy2base64``), its shape and dtype inside."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def decode_int32_b64(text: str) -> np.ndarray:
    """SGLang's: base64 of the raw int32 bytes of [tokens - 1, num_hidden_layers, top_k],
    flat: the reader reshapes it by the model's shape (state_capturer/routed_experts.py
    ``extract_routed_experts_from_meta_info``; here ``trainer/batch.py``)."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32)
