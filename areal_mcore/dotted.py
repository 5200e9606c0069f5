"""Objects named by dotted path in configs (``reward.fn``, ``rollout.episode``)."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str, default: str, kind: str = "name") -> Any:
    """The object at ``path`` (``package.module:name``, the name may be dotted; ``kind``
    says what it should be in the messages, e.g. "function").

    Raises:
        ValueError: the path is malformed, its module does not import or it names nothing;
            the message says which (``default`` is quoted as an example).
    """
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"must look like 'package.module:{kind}' (the default is {default!r})")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(f"cannot be imported: {type(e).__name__}: {e} (is its folder on PYTHONPATH?)") from None
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"names no {kind}: module {module_name!r} has no {name!r}")
    return obj
