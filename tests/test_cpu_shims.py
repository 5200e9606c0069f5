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
