"""Reward worker process: JSON lines in on stdin, ``{"id", "reward"}`` lines out on stdout
(with ``"error"`` when the reward function raised or returned no number: it scores 0).

    python -m areal_mcore.reward.worker FN_PATH INNER_TIMEOUT_S

Started by ``RewardPool`` with address-space and CPU-time limits; each call runs in this
process's main thread, so math-verify's ``signal.alarm`` timeouts work. Anything that
still overruns is killed from the parent.
"""

from __future__ import annotations

import json
import sys

from areal_mcore.reward.fn import load_reward_fn, reward_caller


def main() -> None:
    import math_verify  # noqa: F401  (import once, before the first request's deadline)

    fn_path, timeout = sys.argv[1], int(sys.argv[2])
    call = reward_caller(load_reward_fn(fn_path), timeout)  # checked at config load already
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        item = json.loads(line)
        out = {"id": item["id"]}
        try:
            out["reward"] = call(item)
        except Exception as e:  # noqa: BLE001  (hostile text must score 0, never crash the worker)
            out.update(reward=0.0, error=f"{type(e).__name__}: {e}"[:500])
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
