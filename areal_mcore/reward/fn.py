"""The reward function by dotted path (``reward.fn: package.module:function``).

A reward function is called once per sample inside a reward worker (``reward/worker.py``)
as ``fn(prompt, completion, prompt_ids, completion_ids, solutions, **fields) -> float``:
``prompt`` and ``completion`` are the decoded texts, the ids are the token ids the servers
saw and sampled, ``solutions`` the problem's gold answers and ``fields`` the dataset row's
other columns (``data/jsonl.py: row_fields``) and ``source``, the row's ``file:line``. A function that also names a
``timeout_s`` parameter gets the worker's inner timeout (a third of ``reward.timeout_s``),
as boba's math-verify check does. The path is imported and its signature checked when the
config loads, so a typo fails there, naming the key, not in a worker mid-run.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path

from areal_mcore.dotted import import_dotted

DEFAULT_FN = "areal_mcore.reward.boba:boba_reward_fn"
SIGNATURE = "fn(prompt, completion, prompt_ids, completion_ids, solutions, **fields) -> float"
_ARGS = ("prompt", "completion", [0], [0], ["1"])


def load_reward_fn(path: str) -> Callable[..., float]:
    """The function at ``path`` (``package.module:function``).

    Raises:
        ValueError: the path is malformed, the module does not import, the name is missing
            or not a plain function of ``SIGNATURE``; the message says which.
    """
    fn = import_dotted(path, DEFAULT_FN, "function")
    if not callable(fn):
        raise ValueError(f"is not callable: {path} is a {type(fn).__name__}")
    if inspect.iscoroutinefunction(fn):
        raise ValueError("is an async function; reward workers call a plain function returning a float")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: cannot be checked
        raise ValueError(f"has no inspectable signature; it must be {SIGNATURE}") from None
    try:
        sig.bind(*_ARGS, source="file:1")
    except TypeError as e:
        raise ValueError(f"has the wrong signature {path.partition(':')[2]}{sig} ({e}); "
                         f"it must be {SIGNATURE}") from None
    return fn


def import_root(path: str) -> str | None:
    """The sys.path folder ``path``'s module was imported from (None for a built-in one), so
    that the worker processes, started with ``python -m``, import it from the same place."""
    module = sys.modules.get(path.partition(":")[0])
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    root = Path(file).resolve().parent
    if Path(file).name == "__init__.py":
        root = root.parent
    for _ in range(module.__name__.count(".")):
        root = root.parent
    return str(root)


def reward_caller(fn: Callable[..., float], timeout_s: int) -> Callable[[dict], float]:
    """``call(item)``: ``fn`` on one worker request (``item``: the pool's JSON line), raising
    ``TypeError`` when it returns something that is not a finite number."""
    extra = {"timeout_s": timeout_s} if "timeout_s" in inspect.signature(fn).parameters else {}

    def call(item: dict) -> float:
        value = fn(item["prompt"], item["completion"], item["prompt_ids"], item["completion_ids"],
                   item["solutions"], **item["fields"], **extra)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"the reward function returned {value!r}, not a finite float")
        return float(value)

    return call
