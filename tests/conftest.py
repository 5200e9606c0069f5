import os

# No oversubscription of the 2-core CI machine, in this process and in every one it starts
# (servers, gloo ranks, CLI runs, vLLM): each reads OMP_NUM_THREADS when torch loads
# OpenMP, so it is set before any import of torch. Under xdist, OpenMP pools of 2 threads
# per process spin-waited on each other: the same vLLM PPO test took 544 s beside other
# tests and 138 s alone.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _tiers  # noqa: E402
import torch  # noqa: E402

# Deterministic, and one intra-op thread here too.
torch.manual_seed(0)
torch.set_num_threads(1)

# Without a GPU the Triton kernels (kernels/) run on CPU tensors through Triton's
# interpreter. triton.jit reads TRITON_INTERPRET when a kernel is *defined*, i.e. when its
# module is first imported, so it is set here, before any test module imports one; the
# spawned gloo ranks inherit it. Production code never sets it ("auto" picks torch on CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# Same examples on every run (CI must be deterministic); no example database on disk.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


_tiers.guard_server_launches()


def pytest_runtest_setup(item):
    _tiers.current = item  # before the item's fixtures: a module fixture's server is checked too


def pytest_collection_modifyitems(config, items):
    """Under xdist (`make test`: `--dist loadscope`) a module runs on one worker, so its
    module-scoped servers start once (and the Slurm jobs, all in one module, one at a time
    on the cluster's two nodes). The longest modules go first (`--no-loadscope-reorder`
    keeps this order), so none starts last and runs alone: longest by the last recorded
    `make test` (module_seconds.json, from scripts/test_durations.py --order), a module
    not in it by its heaviest marker."""
    stage = "mcore019" if os.environ.get("AREAL_MCORE_OTHER_PY") else "main"  # make test-mcore019 sets it
    recorded = _module_seconds().get(stage, {})
    guess = {"slurm": 600, "server": 60, "slow": 30, "multirank": 20}  # seconds, for a module not recorded

    def seconds(item):
        return max((guess[m.name] for m in item.iter_markers() if m.name in guess), default=1)
    cost: dict[str, float] = {}
    for item in items:  # order within a module is kept
        name = item.module.__name__
        cost[name] = recorded.get(name, max(cost.get(name, 0), seconds(item)))
    items.sort(key=lambda item: -cost[item.module.__name__])


def _module_seconds() -> dict:
    import json
    import pathlib

    path = pathlib.Path(__file__).with_name("module_seconds.json")
    return json.loads(path.read_text()) if path.is_file() else {}
