"""What a test needs beyond this process, as pytest markers (pyproject.toml lists them).

``make test-fast`` runs the tests that need none of: a rollout server process (``server``),
a launch of several gloo ranks (``multirank``), a second venv (``venv``: vLLM's, or the
megatron-core 0.19 one), the local Slurm cluster (``slurm``), or minutes (``slow``).
The test helpers that start those things call ``needs(marker)``, which fails a test that
lacks the marker, so a new caller cannot slip into the fast tier unmarked. A rollout
server started by the code under test (``train()`` and ``eval`` launch their own) is
checked the same way, in the test's process and in the ranks ``run_gloo`` spawns.
"""

from __future__ import annotations

import pytest

# The running test's item (conftest.pytest_runtest_setup sets it before its fixtures).
current: pytest.Item | None = None
# In a rank spawned by run_gloo: the markers of the test that spawned it.
inherited: tuple[str, frozenset[str]] | None = None


def marks() -> tuple[str, frozenset[str]] | None:
    """(test id, its marker names), or None outside a test."""
    if current is not None:
        return current.nodeid, frozenset(m.name for m in current.iter_markers())
    return inherited


def needs(marker: str) -> None:
    now = marks()
    if now is not None and marker not in now[1]:
        message = (f"{now[0]} needs what the {marker!r} marker stands for (tests/_tiers.py) but "
                   f"is not marked: add @pytest.mark.{marker}")
        if current is None:  # in a spawned rank: raise, the parent reports it
            raise RuntimeError(message)
        pytest.fail(message, pytrace=False)


def guard_server_launches(test_marks=None) -> None:
    """Every rollout server this process starts (the helpers', or one the code under test
    launches, as ``train()`` and ``eval`` do) must belong to a test marked ``server``.
    In a rank spawned by run_gloo, ``test_marks`` are the spawning test's."""
    global inherited
    if test_marks is not None:
        inherited = test_marks
    from areal_mcore.rollout import servers

    real_init = servers.ServerProcess.__init__
    if getattr(real_init, "guarded", False):
        return

    def checked_init(self, *args, **kwargs):
        needs("server")
        real_init(self, *args, **kwargs)
    checked_init.guarded = True
    servers.ServerProcess.__init__ = checked_init
