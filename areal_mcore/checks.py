"""Validation helpers for the config dataclasses (a leaf: nothing from areal_mcore).

A dataclass names its own fields only (``mode``, not ``weight_sync.mode``): the loader
(``config.load_config``) knows where the section sits and prefixes its dotted path, so
every message names the full key exactly once, also for a dataclass nested two levels deep.
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A value a config dataclass rejects: ``key`` is the field inside that dataclass,
    ``why`` the rest of the message (how to fix it)."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}{why}")
        self.key, self.why = key, why

    def at(self, path: str) -> str:
        """The message with the section's dotted ``path`` (e.g. ``"ppo.reward_norm."``)."""
        return f"{path}{self.key}{self.why}"


def field_error(key: str, value: Any, why: str) -> FieldError:
    """``key=value <why>``, the one shape of a config value error."""
    return FieldError(key, f"={value!r} {why}")


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise field_error(key, value, f"is not allowed; choose one of {list(allowed)}")


def check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise field_error(key, value, f"must be {'>= 0' if allow_zero else '> 0'}")


def check_unit_interval(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise field_error(key, value, "must be in [0, 1]")
