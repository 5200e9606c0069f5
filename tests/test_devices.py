"""Device binding from LOCAL_RANK (a mocked CUDA: no GPU in CI)."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from areal_mcore import devices
from areal_mcore.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeCuda:
    """torch.cuda's device calls on a machine with ``count`` GPUs, recording set_device."""

    def __init__(self, count: int):
        self.count, self.current, self.calls = count, 0, []

    def install(self, monkeypatch_setattr) -> None:
        monkeypatch_setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch_setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch_setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch_setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, index) -> None:
        self.calls.append(int(index))
        self.current = int(index)


def test_bind_local_device_local_rank_3_binds_cuda_3(monkeypatch):
    cuda = FakeCuda(8)
    cuda.install(monkeypatch.setattr)
    assert devices.bind_local_device({"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert cuda.calls == [3]
    devices.check_bound({"LOCAL_RANK": "3"})  # no error once bound


def test_bind_local_device_one_visible_gpu_binds_it(monkeypatch):
    cuda = FakeCuda(1)  # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds this rank's GPU only
    cuda.install(monkeypatch.setattr)
    assert devices.bind_local_device({"LOCAL_RANK": "5"}) == torch.device("cuda", 0)
    assert cuda.calls == [0]


def test_bind_local_device_more_ranks_than_gpus_raises(monkeypatch):
    FakeCuda(4).install(monkeypatch.setattr)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=4 but this process sees 4 GPUs"):
        devices.bind_local_device({"LOCAL_RANK": "4"})


def test_check_bound_unbound_rank_raises(monkeypatch):
    FakeCuda(8).install(monkeypatch.setattr)  # current device stays 0, as CUDA leaves it
    with pytest.raises(RuntimeError, match="bind_local_device"):
        devices.check_bound({"LOCAL_RANK": "1"})


def test_bind_local_device_without_cuda_is_cpu_and_touches_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device without CUDA"))
    assert devices.bind_local_device({"LOCAL_RANK": "1"}) == torch.device("cpu")


def _torchrun_rank(rank: int, world: int, port: int, queue, overrides: list[str]) -> None:
    """One rank of ``areal-mcore sft`` as torchrun starts it, on a node with 2 fake GPUs.

    init_process_group is wrapped to use gloo (the requested backend is recorded) and the
    SFT step is replaced by the actor's own binding check plus a record of the device."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch.distributed as dist

        from areal_mcore import cli
        from areal_mcore.actor import megatron_actor
        from areal_mcore.trainer import sft

        events, cuda = [], FakeCuda(2)
        cuda.install(lambda obj, name, value: setattr(obj, name, value))
        real_set = cuda.set_device
        cuda.set_device = lambda i: (events.append(f"set_device({i})"), real_set(i))[1]
        torch.cuda.set_device = cuda.set_device
        real_init = dist.init_process_group

        def init(backend, **kw):
            events.append(f"init_process_group({backend}) on cuda:{torch.cuda.current_device()}")
            real_init("gloo", **kw)
        dist.init_process_group = init

        def fake_sft(cfg):
            megatron_actor.check_bound()  # what MegatronActor.__init__ runs first
            events.append(f"actor built on cuda:{torch.cuda.current_device()}")
            return [1.0, 0.5]
        sft.run_sft = fake_sft
        code = cli.main(["sft", "--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"), *overrides])
        dist.destroy_process_group()
        queue.put((rank, code, events, None))
    except BaseException:
        queue.put((rank, None, None, traceback.format_exc()))


@pytest.mark.multirank
def test_torchrun_ranks_bind_their_own_gpu_before_the_process_group_and_actor(tmp_path):
    from areal_mcore.data.tiny_assets import TinyAssetsConfig, build_tiny_assets

    # The config's paths are checked before any rank starts: give it real (tiny) ones.
    assets = build_tiny_assets(TinyAssetsConfig(out_dir=str(tmp_path / "assets"), n_train=16, n_test=4,
                                                hidden_size=32, intermediate_size=64, num_layers=1))
    overrides = [f"sft.base_model={assets['model']}", f"model_path={assets['model']}",
                 f"sft.output_dir={tmp_path / 'sft'}", f"dataset.path={assets['train']}",
                 f"eval_dataset.path={assets['test']}", f"trainer.log_dir={tmp_path / 'runs'}"]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_torchrun_rank, args=(r, 2, port, queue, overrides)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, code, events, err in results:
        assert err is None, err
        assert code == 0
        assert events == [f"set_device({rank})", f"init_process_group(nccl) on cuda:{rank}",
                          f"actor built on cuda:{rank}"]


class PerThreadCuda(FakeCuda):
    """As CUDA keeps it: each thread's current device is 0 until that thread sets it."""

    def __init__(self, count: int):
        import threading

        super().__init__(count)
        self.local = threading.local()

    def install(self, monkeypatch_setattr) -> None:
        super().install(monkeypatch_setattr)
        monkeypatch_setattr(torch.cuda, "current_device", lambda: getattr(self.local, "device", 0))

    def set_device(self, index) -> None:
        self.local.device = int(index)


def test_every_thread_the_trainer_runs_cuda_work_on_is_on_the_ranks_gpu(monkeypatch):
    """The event-loop thread and the weight syncer's worker threads (the object all-gather
    over NCCL, the gather, the broadcast) worked on cuda:0 whatever the rank's GPU: the
    current device is per thread, and they never set it."""
    import asyncio
    import inspect

    from areal_mcore.trainer.event_loop import LoopThread
    from areal_mcore.weight_sync import disk, distributed, syncer

    PerThreadCuda(8).install(monkeypatch.setattr)
    torch.cuda.set_device(3)  # what bind_local_device does on the main thread of LOCAL_RANK 3
    assert torch.cuda.current_device() == 3
    loop = LoopThread()
    try:
        assert loop.call(torch.cuda.current_device) == 3
        assert loop.run(asyncio.to_thread(torch.cuda.current_device)) == 0  # the trap itself
        sync = object.__new__(syncer.Syncer)  # only its device and _in_thread
        sync._device = torch.device("cuda", 3)
        assert loop.run(sync._in_thread(torch.cuda.current_device)) == 3
    finally:
        loop.close()
    # Every thread job of the syncers goes through _in_thread (or distributed's daemon
    # threads, which bind the device the same way).
    sources = [inspect.getsource(m) for m in (syncer, distributed, disk)]
    assert sum(s.count("asyncio.to_thread(") for s in sources) == 1
    assert all("self._in_thread(" in s for s in sources[1:])
    assert sum(s.count("threading.Thread(") for s in sources) == 1
    assert "bound = inherit_device(fn, self._device)" in sources[1]
