"""Who may call the rollout servers (docs/rollout.md#security).

Every server a run launches requires a bearer key on every route but ``/health``: the
weight routes let a caller replace the served weights (``update_weights_from_disk``) or
make the server join a process group at an address of its choosing
(``init_weights_update_group``, which blocks generation while it waits). The key is
``server.api_key`` when set, else ``$AREAL_ROLLOUT_API_KEY`` (how a launcher hands one on
without a command line), else a random one the launching tool makes for that launch
(the trainer keeps it in ``<run>/rollout_api_key``, mode 0600).

A key never goes on a command line, which ``ps`` shows every user of the node: each engine
takes it by the means its own code reads (``Engine.auth`` of ``rollout/engines/``), from
the environment (``/proc/PID/environ`` is readable by the process's owner only) or from a
0600 file.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_mcore.rollout.config import ServerConfig
from areal_mcore.run_dir import new_key

# A launcher's key for its servers (the embedded server reads it) and, on Slurm, for the
# trainer step that talks to servers it did not start (server.addresses).
KEY_ENV = "AREAL_ROLLOUT_API_KEY"


def configured_key(cfg: ServerConfig, env: dict | None = None) -> str | None:
    """The key the user or a launcher gave: ``server.api_key``, else ``$AREAL_ROLLOUT_API_KEY``
    of ``env`` (default: this process's), else None. What a client of servers someone else
    started (``server.addresses``) sends."""
    env = os.environ if env is None else env
    return cfg.api_key or env.get(KEY_ENV) or None


def launch_key(cfg: ServerConfig, run=None) -> str:
    """The key for servers this process launches: the configured one, else a fresh random
    one, stored (0600) in ``run`` (a ``run_dir.RunDir``) when given."""
    key = configured_key(cfg)
    if key:
        return key
    return run.new_rollout_key() if run is not None else new_key()


def within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether ``path`` is ``root`` or lies under it, symlinks and ``..`` resolved (a link
    inside the root that points out of it is outside)."""
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return real == top or top in real.parents
