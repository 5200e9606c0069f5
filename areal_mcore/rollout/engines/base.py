"""The seam between the rollout client core and one inference engine.

The client core (``rollout/client.py``: load balancing, failover, wire rids,
resubmission of aborted completions, per-token versions) and the weight syncer
(``weight_sync/syncer.py``: buckets, groups, stage turns, failure handling) are one piece
each; everything that differs between engines sits behind ``Engine``: the launch command,
the generate request and its response, pause/resume/abort, weight versions and the
weight-update protocol. A new engine is a new module here, never a branch elsewhere.

``fleet`` below is a ``rollout.fleet.Fleet`` (the run's is the ``RolloutClient``):
engines send through its ``request`` (one server) and ``all`` (every server, every
failure reported) and read its ``servers``; they never import the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    """One inference engine's protocol. Stateless: per-server state lives in the client."""

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

    def generate_request(self, s: Server, input_ids: list[int], params: SamplingParams,
                         wire_rid: str) -> tuple[str, dict]:
        """(path, JSON body) of one generate attempt."""
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
    def check_distributed_updates(self, fleet: Fleet, pp_size: int) -> None:
        """Raises ``RolloutError`` for servers this engine cannot update over a group."""

    def group_world_size(self, fleet: Fleet) -> int:
        """Trainer rank 0 plus every server's receiving ranks."""
        return 1 + sum(s.tp_size for s in fleet.servers)

    def trainer_transport(self, backend: str) -> str:
        """What the trainer's end of the group is (``weight_sync/transport.py``)."""
        return "torch"

    def flattened_buckets(self, backend: str) -> bool:
        """Whether a bucket may travel as one flat ``uint8`` broadcast."""
        return True

    async def init_group(self, fleet: Fleet, spec: GroupSpec) -> None:
        """Blocks until every server joined; the trainer joins as rank 0 concurrently."""
        raise NotImplementedError

    async def destroy_group(self, fleet: Fleet, group_name: str, backend: str) -> None:
        raise NotImplementedError

    async def begin_update(self, fleet: Fleet, pause_mode: str) -> None:
        """Pauses generation and opens an update session."""
        raise NotImplementedError

    async def update_bucket(self, fleet: Fleet, *, names: list[str], dtypes: list[str],
                            shapes: list[list[int]], group: GroupSpec, flatten: bool,
                            weight_version: str | None) -> None:
        """Servers receive one bucket by ``broadcast(src=0)`` while the trainer sends it."""
        raise NotImplementedError

    async def finish_update(self, fleet: Fleet, pause_mode: str, version: str) -> None:
        """Closes the session, makes the servers report ``version`` and resumes."""
        raise NotImplementedError

    async def end_update(self, fleet: Fleet, *, best_effort: bool) -> None:
        """Closes an open session (best effort: ignoring refusals, on every server)."""
        raise NotImplementedError

    async def update_from_disk(self, fleet: Fleet, path: str, version: str,
                               pause_mode: str) -> None:
        raise NotImplementedError
