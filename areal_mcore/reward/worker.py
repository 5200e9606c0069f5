"""Reward worker process: JSON lines in on stdin, ``{"id", "reward"}`` lines out on stdout.

Started by ``RewardPool`` with address-space and CPU-time limits; each check runs in this
process's main thread, so math-verify's ``signal.alarm`` timeouts work. Anything that
still overruns is killed from the parent.
"""

from __future__ import annotations

import json
import sys

from areal_mcore.reward.boba import boba_reward


def main() -> None:
    import math_verify  # noqa: F401  (import once, before the first request's deadline)

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    timeout = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for line in sys.stdin:
        item = json.loads(line)
        try:
            reward = boba_reward(item["completion"], item["solutions"], timeout_s=timeout)
        except Exception:  # noqa: BLE001  (hostile text must score 0, never crash the worker)
            reward = 0.0
        sys.stdout.write(json.dumps({"id": item["id"], "reward": reward}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
