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
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from areal_mcore.rollout.fleet import BadAnswer
from areal_mcore.rollout.protocol import RolloutError, SamplingParams

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

    def check(self, requested: int, vocab_size: int | None = None) -> None:
        """The contract of every engine's answer, whatever its wire shape; raises
        ``ValueError`` saying what is wrong (``Engine.read_generate`` names the server).

        - token ids are ints in [0, ``vocab_size``) (None: unchecked, no model known): an
          id past the served model's vocabulary crashes the trainer's embedding lookup, or,
          inside megatron's padded vocabulary, trains on a row no tokenizer has;
        - at most ``requested`` tokens (the next resubmission asks for the rest);
        - one logprob per token, a number that is not NaN nor +inf. -inf (log 0) passes:
          the PPO loss masks non-finite behaviour logprobs out of the gradient (the token,
          or its sequence at sequence level: ``nonfinite_ratio``, tests/test_ppo_loss.py,
          test_ppo_robustness.py), so such a sample is not worth a retry;
        - one weight version per token;
        - ``finish_reason`` is a dict whose ``type`` is stop, length or abort.

        Written for ~10k-token answers at thousands per step: C-level passes (``map``,
        ``min``/``max``, ``sum``) first, a per-token walk only to name what failed."""
        ids, logprobs = self.output_ids, self.logprobs
        if type(ids) is not list or not set(map(type, ids)) <= {int}:  # bool is no id either
            bad = next((i for i, t in enumerate(ids) if type(t) is not int), None) if type(ids) is list else None
            raise ValueError(f"output token ids must be a list of ints, got {describe(ids)}" if bad is None else
                             f"output token {bad} is {ids[bad]!r}, not an int token id")
        if len(ids) > requested:
            raise ValueError(f"{len(ids)} output tokens for the {requested} asked for")
        high = vocab_size if vocab_size is not None else math.inf
        if ids and (min(ids) < 0 or max(ids) >= high):
            i = next(i for i, t in enumerate(ids) if not 0 <= t < high)
            where = (f"outside the served model's vocabulary [0, {vocab_size})" if vocab_size is not None
                     else "a negative id")
            raise ValueError(f"output token {i} has id {ids[i]}, {where}")
        if type(logprobs) is not list or len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} output tokens but logprobs: {describe(logprobs)}")
        if not set(map(type, logprobs)) <= {float, int}:
            i = next(i for i, x in enumerate(logprobs) if type(x) not in (float, int))
            raise ValueError(f"the logprob of output token {i} is " + (
                "null (SGLang's orjson writes NaN and infinities so)" if logprobs[i] is None
                else f"{logprobs[i]!r}, not a number"))
        if not math.isfinite(sum(logprobs)):  # NaN, +inf, or a -inf that passes
            for i, x in enumerate(logprobs):
                if x != x or x == math.inf:
                    raise ValueError(f"the logprob of output token {i} (id {ids[i]}) is {x}")
        if len(self.versions) != len(ids):
            raise ValueError(f"{len(ids)} output tokens but {len(self.versions)} weight versions")
        reason = self.finish_reason
        if not isinstance(reason, dict) or reason.get("type") not in FINISH_TYPES:
            raise ValueError(f"finish_reason {reason!r} is not a dict with type one of {FINISH_TYPES}")


FINISH_TYPES = ("stop", "length", "abort")


def describe(value) -> str:
    """A short description of a value in a bad answer (a list by its length)."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


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

    def auth(self, cfg: ServerConfig, env: dict[str, str], *, api_key: str | None,
             weights_root: str | None, private_dir: str) -> tuple[list[str], dict[str, str]]:
        """How a server learns the key its callers must send (``api_key``; None: none) and
        the folder ``update_weights_from_disk`` may read from (``weights_root``; None:
        anywhere): (arguments to add to ``command``, the environment ``env`` becomes). The
        key never goes in the arguments (``ps`` shows them to every user of the node): by
        the environment or a 0600 file in ``private_dir``, as the engine's code reads it
        (``rollout/auth.py``)."""
        raise NotImplementedError

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
        """One generate answer (a JSON object) in our terms; a shape the engine never
        sends raises ``ValueError`` saying what is wrong (``read_generate`` calls it)."""
        raise NotImplementedError

    def read_generate(self, s: Server, out, requested: int, *, vocab_size: int | None = None) -> Chunk:
        """``parse_generate`` of what a generate call returned (``Fleet.request``: parsed
        JSON, or the text of a body that is not JSON), checked against the contract every
        engine keeps (``Chunk.check``). A broken answer raises ``BadAnswer`` naming the
        server: a server fault, which the client fails over as it does a 5xx."""
        try:
            if not isinstance(out, dict):
                raise ValueError("an empty body" if out == "" else f"{describe(out)}, not a JSON object")
            chunk = self.parse_generate(s, out, requested)
            chunk.check(requested, vocab_size)
            return chunk
        # KeyError and the like: a shape parse_generate's own checks did not foresee.
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            what = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
            address = s.address if s is not None else "?"
            raise BadAnswer(f"{address}: bad {self.name} generate answer: {what}", [address]) from None

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


def answer_object(s: Server, path: str, answer) -> dict:
    """A control call's answer (``Fleet.request``: parsed JSON, or the text of a body
    that is not JSON) as the JSON object it must be, else ``RolloutError`` naming the server."""
    if not isinstance(answer, dict):
        raise RolloutError(f"{s.address}{path}: answered {describe(answer) if answer != '' else 'an empty body'}, "
                           "not a JSON object", [s.address])
    return answer


def answer_field(s: Server, path: str, answer, key: str, convert=str):
    """``convert(answer[key])`` of a control call's answer; a missing or mistyped field
    raises ``RolloutError`` naming the server and the field (never a KeyError)."""
    value = answer_object(s, path, answer).get(key)
    try:
        if value is None:
            raise ValueError
        return convert(value)
    except (TypeError, ValueError):
        raise RolloutError(f"{s.address}{path}: the answer's {key!r} is "
                           f"{'missing' if value is None else describe(value)}: {describe(answer)}",
                           [s.address]) from None


def positive_int(value) -> int:
    """A size a server reports (``answer_field``'s ``convert``): an int >= 1."""
    if type(value) is not int or value < 1:
        raise ValueError
    return value


def decode_npy_b64(text: str) -> np.ndarray:
    """vLLM's encoding of ``routed_experts``: base64 of ``np.save``'s .npy bytes
    (vllm/utils/serial_utils.py ``numpy2base64``), its shape and dtype inside."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def decode_int32_b64(text: str) -> np.ndarray:
    """SGLang's: base64 of the raw int32 bytes of [tokens - 1, num_hidden_layers, top_k],
    flat: the reader reshapes it by the model's shape (state_capturer/routed_experts.py
    ``extract_routed_experts_from_meta_info``; here ``trainer/batch.py``)."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32)
