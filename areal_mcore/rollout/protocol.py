"""The SGLang request fields we speak (sglang 0.5.23 names), shared by the client and the
embedded server so that neither can drift from the other; docs/sglang_api.md describes
them and tests/test_rollout_contract.py pins them against SGLang's own code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SGLANG_API_VERSION = "0.5.23"
# SGLang <= 0.5.20 (pinned by AReaL/slime) has no begin/end_weight_update. Every version
# from 0.5.10 on reports ``weight_version`` in /model_info; their /get_weight_version
# answers 404 ("deprecated ... use /model_info"), so it is never called.
LAST_OLD_API = (0, 5, 20)
# PauseGenerationReqInput.mode (SGLang 0.5.10-0.5.23).
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(kw_only=True)
class SamplingParams:
    """``sampling_params`` of ``POST /generate``; field names are SGLang's."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_new_tokens:
            raise ValueError(f"sampling_params.min_new_tokens must be >= 0, got {self.min_new_tokens}")

    @classmethod
    def from_json(cls, raw: dict) -> SamplingParams:
        """Strict parse: unknown keys are rejected, as SGLang >= 0.5.22 does."""
        if not isinstance(raw, dict):
            raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ValueError(f"unknown sampling_params key(s) {unknown}; allowed: {allowed}")
        kinds = {"max_new_tokens": int, "top_k": int, "min_new_tokens": int,
                 "temperature": (int, float), "top_p": (int, float), "ignore_eos": bool}
        for key, kind in kinds.items():
            value = raw.get(key)
            if value is not None and (not isinstance(value, kind) or
                                      (kind is int and isinstance(value, bool))):
                raise ValueError(f"sampling_params.{key} must be {getattr(kind, '__name__', 'a number')}, "
                                 f"got {value!r}")
        stop = raw.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
            raise ValueError(f"sampling_params.stop_token_ids must be a list of ints, got {stop!r}")
        seed = raw.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"sampling_params.sampling_seed must be an int, got {seed!r}")
        return cls(**{k: v for k, v in raw.items() if v is not None})

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: '0.5.20.post1', '0.5.20rc1' and
    '0.5.20.dev3+g1234' -> (0, 5, 20); a pre-release sorts with its release (0.5.20rc1
    has 0.5.20's API). Stops at the first part that does not start with a digit."""
    out = []
    for part in text.strip().lstrip("vV").split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) < len(part):  # '20rc1': the release number ends here
            break
    return tuple(out)


def finish_stop(token: int) -> dict:
    return {"type": "stop", "matched": token}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}


class RolloutError(RuntimeError):
    """A request that no server could serve, or servers that refused an admin call
    (``failed`` lists their addresses)."""

    def __init__(self, message: str, failed: list[str] | None = None):
        super().__init__(message)
        self.failed = failed or []
