"""areal_mcore/collectives.py: tensors go to the group's device and back; no module but it
calls torch.distributed collectives (the audit); NCCL-like groups on an emulated CUDA."""

from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo
from _fake_cuda import FakeCuda, is_fake_cuda, nccl_like
from test_dispatch import _samples

from areal_mcore import collectives
from areal_mcore.algo.config import NormConfig, PPOConfig
from areal_mcore.trainer.dispatch import RolloutShard

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "batch_isend_irecv", "monitored_barrier",
}
# ProcessGroup methods (a group object used directly, e.g. one formed without torch's registry).
GROUP_METHODS = {"allreduce", "allgather", "broadcast", "send", "recv", "barrier", "reduce_scatter", "alltoall"}
ALLOWED = {
    "areal_mcore/collectives.py": "the one place",
    # The embedded rollout server's side of the weight-update group, formed like SGLang's
    # init_custom_process_group; on GPU clusters SGLang itself stands here.
    "areal_mcore/rollout/weights.py": "inference side (SGLang's role)",
}


def direct_collective_calls(source: str) -> list[str]:
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` / a name imported
    from torch.distributed / ``<...group...>.<method>(...)`` calls in ``source``."""
    tree = ast.parse(source)
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif node.module == "torch.distributed":
                names |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        text = ast.unparse(f)
        if isinstance(f, ast.Name) and f.id in names:
            found.append(f"{node.lineno}: {text}")
        elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and (
                (isinstance(f.value, ast.Name) and f.value.id in aliases) or ast.unparse(f.value) == "torch.distributed"):
            found.append(f"{node.lineno}: {text}")
        elif isinstance(f, ast.Attribute) and f.attr in GROUP_METHODS and "group" in ast.unparse(f.value).lower():
            found.append(f"{node.lineno}: {text}")
    return found


def test_no_module_but_collectives_calls_torch_distributed_collectives():
    offenders = {}
    files = [p for d in ("areal_mcore", "kernels", "tools") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        calls = direct_collective_calls(path.read_text())
        if calls and rel not in ALLOWED:
            offenders[rel] = calls
    assert not offenders, f"call areal_mcore.collectives instead: {offenders}"
    assert direct_collective_calls((ROOT / "areal_mcore/collectives.py").read_text())  # it does find calls


def test_audit_finds_every_spelling_of_a_direct_call():
    src = ("import torch.distributed as d\nfrom torch import distributed\nimport torch\n"
           "from torch.distributed import all_reduce as ar\n"
           "d.all_reduce(x)\ndistributed.broadcast(x, 0)\ntorch.distributed.barrier()\nar(x)\n"
           "self._group.broadcast([x], 0)\nd.get_rank()\n")
    assert [c.split(": ")[1] for c in direct_collective_calls(src)] == [
        "d.all_reduce", "distributed.broadcast", "torch.distributed.barrier", "ar", "self._group.broadcast"]


def _gloo_values(rank, world):
    g = dist.group.WORLD
    total = collectives.all_reduce(torch.tensor([rank + 1.0]), g)
    top = collectives.all_reduce(torch.tensor([rank]), g, op=dist.ReduceOp.MAX)
    b = collectives.broadcast(torch.tensor([rank * 10]), 1, g)
    parts = collectives.all_gather(torch.tensor([rank, -rank]), g)
    to_0 = collectives.gather(torch.tensor([rank, 2 * rank]), 0, g)
    box = torch.zeros(2)
    if rank == 0:
        collectives.send(torch.tensor([7.0, 8.0]), 1, g)
    else:
        collectives.recv(box, 0, g)
    collectives.barrier(g)
    return (total.tolist(), top.tolist(), b.tolist(), [p.tolist() for p in parts], box.tolist(),
            collectives.all_gather_object({"r": rank}, g), collectives.broadcast_object(f"from {rank}", 0, g),
            str(collectives.group_device(g)), to_0 and [p.tolist() for p in to_0])


def test_collectives_on_gloo_return_the_reduced_values():
    r0, r1 = run_gloo(_gloo_values, 2)
    for rank, r in enumerate((r0, r1)):
        assert r[:4] == ([3.0], [1], [10], [[0, 0], [1, -1]])
        assert r[4] == ([0.0, 0.0] if rank == 0 else [7.0, 8.0])
        assert r[5:] == ([{"r": 0}, {"r": 1}], "from 0", "cpu", [[0, 0], [1, 2]] if rank == 0 else None)


def _unreceived_broadcast(rank, world):
    if rank == 1:  # never takes part
        time.sleep(6)
        return None
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        collectives.broadcast_many([torch.ones(4), torch.ones(2**16)], 0, dist.group.WORLD, timeout_s=2)
    return time.monotonic() - t


def test_a_broadcast_nobody_receives_raises_at_its_bound_not_the_groups_timeout():
    took, _ = run_gloo(_unreceived_broadcast, 2)
    assert 1.5 < took < 5, took


def test_an_nccl_broadcast_that_never_completes_raises_at_its_bound(monkeypatch):
    """vLLM's PyNcclCommunicator only queues the broadcast on the stream (ncclBroadcast) and
    has no watchdog: an event that never completes stands for a peer that never joined."""
    sent = []

    class Event:
        def record(self, stream):
            pass

        def query(self):
            return False

    class Communicator:
        def broadcast(self, tensor, src, stream):
            sent.append(tuple(tensor.shape))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: object())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="never received"):
        collectives.broadcast_pynccl([torch.ones(3), torch.ones(2, 2).t()], 0, Communicator(), timeout_s=0.3)
    assert sent == [(3,), (2, 2)] and time.monotonic() - t < 3


def _unreceived_nccl_broadcast(rank, world):
    g = dist.new_group([0, 1])
    log = nccl_like(setattr, g)
    if rank == 1:  # never takes part
        time.sleep(6)
        return None
    with FakeCuda():
        tensors = [torch.ones(4, device="cuda"), torch.ones(2**16, device="cuda")]
        t = time.monotonic()
        try:
            collectives.broadcast_many(tensors, 0, g, timeout_s=2)
            error = None
        except Exception as e:  # noqa: BLE001 - returned to the test
            error = f"{type(e).__name__}: {e}"
    return time.monotonic() - t, error, log


def test_an_nccl_group_broadcast_nobody_receives_is_polled_to_its_bound_never_waited_with_a_timeout():
    """NCCL's ``Work.wait(timeout)`` aborts the communicator at its bound, and the group's
    watchdog can see that error before the sync's own abort marks the group terminating:
    with TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3 it ends the process instead of the push
    failing (collectives.broadcast_many). Over an NCCL-like group (tests/_fake_cuda.py:
    ``NcclWork`` logs such a wait) the bound is polled, and the push's error path still
    gets an exception at its bound (weight_sync/distributed.py: ``_answers``)."""
    took, error, log = run_gloo(_unreceived_nccl_broadcast, 2)[0]
    assert log == ["broadcast", "broadcast"], log  # no "wait(timeout)"
    assert error is not None and error.startswith("TimeoutError") and "never joined" in error, error
    assert 1.5 < took < 5, took


def _ppo() -> PPOConfig:
    return PPOConfig(reward_bias=-0.5, reward_scaling=10.0,
                     reward_norm=NormConfig(mean_level="group", std_level="group", group_size=4),
                     adv_norm=NormConfig(mean_level="batch", std_level="batch"))


def _nccl_like_dp(rank, world):
    """Rank r's share of a batch: to_train_batch over a plain gloo DP group (CPU), then over
    an NCCL-like one with CPU inputs and with inputs on the (emulated) GPU."""
    from areal_mcore.packing import allocate_micro_batches_synced
    from areal_mcore.trainer.batch import to_train_batch

    samples = _samples(4, 4, seed=rank)
    reference = to_train_batch(samples, _ppo(), dp_group=dist.new_group([0, 1]))
    dp = dist.new_group([0, 1])
    log = nccl_like(setattr, dp)  # 3 and 5 sequences of 5 tokens, cap 10: 2 and 3 bins -> both 3
    out = {}
    with FakeCuda():
        try:  # what batch.py did before: a CPU tensor straight into the group
            dist.all_reduce(torch.ones(2), group=dp)
        except RuntimeError as e:
            out["raw_cpu"] = str(e)
        host = torch.tensor([rank + 1.0])
        collectives.all_reduce(host, dp)  # moved to cuda:0 for the collective, back to the CPU
        out["host"] = (host.tolist(), str(host.device))
        cpu_batch = to_train_batch(samples, _ppo(), dp_group=dp)
        shard = RolloutShard(**{f.name: getattr(RolloutShard.from_samples(samples), f.name).cuda()
                                for f in dataclasses.fields(RolloutShard)})
        gpu_batch = to_train_batch(shard, _ppo(), dp_group=dp)
        out["gpu_fields"] = {k: (str(v.device), is_fake_cuda(v)) for k, v in gpu_batch.fields.items()}
        out["bins"] = allocate_micro_batches_synced([5] * (3 + 2 * rank), 10, group=dp)
        # the exporter's gather (MegatronActor.hf_state_dict): staged onto the device, back on the host
        parts = collectives.gather(torch.tensor([rank + 1.0]), 0, dp)
        out["gathered"] = parts and [(p.tolist(), str(p.device)) for p in parts]
    for name, batch in (("cpu", cpu_batch), ("gpu", gpu_batch)):
        out[name] = {k: torch.equal(v, reference.fields[k]) for k, v in batch.fields.items()}
        out[name]["input_ids"] = torch.equal(batch.input_ids, reference.input_ids)
    out["log"] = log
    return out


def test_to_train_batch_over_an_nccl_like_group_with_inputs_on_the_gpu_equals_gloo():
    for rank, out in enumerate(run_gloo(_nccl_like_dp, 2)):
        assert out["raw_cpu"] == "No backend type associated with device type cpu"  # the emulation bites
        assert out["host"] == ([3.0], "cpu")
        fields = ("loss_mask", "behave", "versions", "empty_response", "adv")
        assert out["cpu"] == out["gpu"] == {**dict.fromkeys(fields, True), "input_ids": True}
        assert out["gpu_fields"] == {k: ("cuda:0", True) for k in fields}
        assert len(out["bins"]) == 3 and sorted(i for b in out["bins"] for i in b) == list(range(3 + 2 * rank))
        assert out["gathered"] == ([([1.0], "cpu"), ([2.0], "cpu")] if rank == 0 else None)
        # host + allocator + 2 per batch (the advantage normalisation's sums) x 2, the gather
        assert out["log"] == ["all_reduce"] * 6 + ["gather"]
