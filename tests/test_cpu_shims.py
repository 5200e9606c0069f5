import importlib

import torch

from areal_mcore.model import cpu_shims


def test_shims_are_not_applied_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_shims, "_APPLIED", False)
    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    type_ = torch.Tensor.type
    assert cpu_shims.apply_cpu_shims() is False
    assert not cpu_shims.shims_active()
    assert torch.cuda.current_device is current_device
    assert torch.cuda.synchronize is synchronize
    assert torch.Tensor.type is type_
    for name in cpu_shims._HARD_CODED_CUDA:
        assert importlib.import_module(name).torch is torch
    from megatron.core.tensor_parallel import random as mp_random

    assert mp_random.CudaRNGStatesTracker is not cpu_shims._CPURNGStatesTracker


def test_cpu_rng_tracker_forks_and_restores_the_default_generator():
    tracker = cpu_shims._CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    with tracker.fork():
        assert not torch.equal(torch.rand(3), inside)  # the named state advanced


def test_modules_with_cuda_streams_get_cpu_streams_and_torch_cuda_is_untouched():
    # megatron-core 0.19: param_and_grad_buffer.start_grad_sync calls
    # torch.cuda.current_stream() on every step (tests/test_actor.py trains through it).
    current_stream = torch.cuda.current_stream
    cpu_torch = cpu_shims._CPUTorch()
    stream = cpu_torch.cuda.current_stream()
    assert isinstance(stream, torch.cpu.Stream)
    stream.wait_stream(stream)  # what megatron calls on it: no-ops on CPU
    assert cpu_torch.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.current_stream is current_stream


def _fresh_jit(finder):
    """megatron/core/jit.py executed anew as the import hook would load it."""
    import importlib.util

    spec = finder.find_spec("megatron.core.jit", importlib.import_module("megatron.core").__path__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatrons_fusions_are_eager_on_cpu_and_compiled_where_cuda_is(monkeypatch):
    """jit_fuser is torch.compile (megatron/core/jit.py), whose every decoration imported
    dynamo and inductor (4.7 s of megatron's import on 2 cores) and would build C++ kernels
    on CPU. Without CUDA it binds to an identity decorator; with CUDA it is torch.compile.
    Importing areal_mcore (light: no torch) installs the hook, before any megatron import."""
    import subprocess
    import sys

    from areal_mcore.model import eager_fusions

    compile_ = torch.compile
    jit = _fresh_jit(eager_fusions._EagerJitFinder())
    assert jit.jit_fuser is eager_fusions._eager and jit.jit_fuser(torch.add) is torch.add
    assert torch.compile is compile_  # only during the module's execution
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _fresh_jit(eager_fusions._EagerJitFinder()).jit_fuser is compile_
    probe = ("import sys, areal_mcore; from areal_mcore.model.eager_fusions import _FINDER; "
             "print(_FINDER in sys.meta_path, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]
