"""Reward worker process: JSON lines in on stdin, one JSON line out per request.

    python -m areal_mcore.reward.worker FN_PATH INNER_TIMEOUT_S MAX_OUTPUT_CHARS

A scoring request (a ``RewardItem``'s fields) gets ``{"id", "reward"}``, with ``"error"``
when the reward function raised or returned no number (it scores 0). A tool request
(``{"id", "tool", "args"}``, ``reward/tool_call.py``) gets ``{"id", "output"}``: the tool's
return value, or what it printed when it returned None, or ``error: ...``, at most
MAX_OUTPUT_CHARS characters. Started by ``RewardPool`` with address-space and CPU-time
limits; each call runs in this process's main thread, so math-verify's ``signal.alarm``
timeouts work. Anything that still overruns is killed from the parent.

The answers go out on a duplicate of the stdout the pool reads; file descriptor 1 itself
points at /dev/null, so nothing a reward function or tool prints (even with ``os.write(1,
...)``) can break the line protocol.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

from areal_mcore.dotted import import_dotted
from areal_mcore.reward.fn import load_reward_fn, reward_caller


class _Capped(io.TextIOBase):
    """A text sink that keeps the first ``limit`` characters and drops the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size = limit, [], 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if self.size < self.limit:
            self.parts.append(s[:self.limit - self.size])
            self.size += len(self.parts[-1])
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters cut]"


def run_tool(tools: dict, item: dict, limit: int) -> str:
    """The observation of one tool request (never raises)."""
    sink = _Capped(limit + 1)
    try:
        if item["tool"] not in tools:
            tools[item["tool"]] = import_dotted(item["tool"], "areal_mcore.reward.tool_call:calculator")
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            value = tools[item["tool"]](item["args"])
        text = sink.text() if value is None else str(value)
    except Exception as e:  # noqa: BLE001  (the model's input: an error is an observation)
        text = f"error: {type(e).__name__}: {e}"
    return _bounded(text, limit)


def main() -> None:
    import math_verify  # once, before the first request's deadline

    fn_path, timeout, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out_stream = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="surrogatepass")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    call = reward_caller(load_reward_fn(fn_path), timeout)  # checked at config load already
    # One parse and verify before "ready": the first builds math-verify's LaTeX parser
    # (0.1-0.9 s, more on a loaded machine), which counted against the first item's
    # deadline and scored a correct answer 0 as a timeout.
    math_verify.verify(math_verify.parse("$1$"), math_verify.parse("\\boxed{1}"))
    tools: dict = {}
    out_stream.write("ready\n")
    out_stream.flush()
    for line in sys.stdin:
        item = json.loads(line)
        out = {"id": item["id"]}
        if "tool" in item:
            out["output"] = run_tool(tools, item, limit)
        else:
            try:
                out["reward"] = call(item)
            except Exception as e:  # noqa: BLE001  (hostile text must score 0, never crash the worker)
                out.update(reward=0.0, error=f"{type(e).__name__}: {e}"[:500])
        out_stream.write(json.dumps(out) + "\n")
        out_stream.flush()


if __name__ == "__main__":
    main()
