"""Lets megatron-core run on CPU with gloo: narrow redirects of CUDA-only calls.

Applied once, and only when CUDA is absent (``apply_cpu_shims``); on a GPU machine this
module changes nothing. Each shim names the megatron call site it serves and, where a
call site exists only in some of the tested versions (``mcore_compat``), the version.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

_APPLIED = False


def apply_cpu_shims() -> bool:
    """Installs the shims if CUDA is unavailable; returns whether they are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _redirect_current_device()
    _cpu_rng_tracker()
    _no_op_synchronize()
    _cuda_factories_to_cpu()
    _cuda_type_names()
    _tied_embedding_setup_on_cpu()
    _moe_split_sizes_on_cpu()
    _uneven_gather_on_gloo()
    _APPLIED = True
    return True


def shims_active() -> bool:
    return _APPLIED


def _redirect_current_device() -> None:
    # megatron passes `device=torch.cuda.current_device()` to tensor factories all over
    # (tensor_parallel/layers.py weights, schedules.py, p2p_communication.py, distributed
    # buffers, optimizer state); "cpu" is a valid device for all of them.
    torch.cuda.current_device = lambda: "cpu"


class _CPURNGStatesTracker:
    """tensor_parallel/random.py: CudaRNGStatesTracker keeps named CUDA generator states
    and forks into them (TP-region dropout, weight init on device, activation recompute).
    On CPU the named states are CPU generator states and the fork swaps the CPU state."""

    def __init__(self, *_, **__):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker = _CPURNGStatesTracker
    # random.py: checkpoint()/_fork_rng save and restore the "cuda" generator with these.
    mp_random._get_cuda_rng_state = lambda *_, **__: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *_, **__: torch.set_rng_state(state)


def _no_op_synchronize() -> None:
    # pipeline_parallel/p2p_communication.py calls torch.cuda.synchronize() after the
    # shape exchange when variable_seq_lengths=True; gloo ops on CPU are already complete.
    torch.cuda.synchronize = lambda *_, **__: None


class _CPUCuda(types.ModuleType):
    """``torch.cuda`` as seen by one megatron module: streams are torch's CPU streams.

    megatron-core 0.19 (not 0.16.1): distributed/param_and_grad_buffer.py,
    ``_ParamAndGradBucketGroup.start_grad_sync`` takes ``torch.cuda.current_stream()`` on
    every call, to wait on CUDA-graph gradient events that CPU params never carry. torch's
    CPU stream has the same ``wait_event``/``wait_stream`` (no-ops: CPU work is in order).
    """

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        if name == "current_stream":
            return lambda *_, **__: torch.cpu.current_stream()
        if name == "Stream":
            return _CPUStream
        if name == "stream":
            return torch.cpu.stream
        return getattr(torch.cuda, name)


class _CPUStream(torch.cpu.Stream):
    """A side stream on CPU, for transformer/moe/token_dispatcher.py (0.16.1 and 0.19):
    MoEAlltoAllTokenDispatcher creates a ``torch.cuda.Stream()`` in ``__init__`` and, in
    ``_maybe_dtoh_and_synchronize``, copies the split sizes to the host on it, then
    ``record_event().synchronize()``. torch's CPU stream is in order but its
    ``record_event`` returns None; here it returns a (no-op) CPU event."""

    def record_event(self, event=None):
        return event or torch.cpu.Event()


class _CPUTorch(types.ModuleType):
    """``torch`` as seen by one megatron module, with ``device="cuda"`` factories on CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CPUCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            @functools.wraps(attr)
            def on_cpu(*args, **kwargs):
                if str(kwargs.get("device")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return on_cpu
        return attr


# Modules that build tensors with a hard-coded device="cuda":
_HARD_CODED_CUDA = (
    "megatron.core.optimizer.optimizer",  # found_inf, _dummy_overflow_buf, _scale_one
    "megatron.core.optimizer.clip_grads",  # total_norm_cuda, grad_norm, dummy_overflow_buf
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens
    "megatron.core.distributed.param_and_grad_buffer",  # tmp_warmup_tensor
    "megatron.core.utils",  # local_multi_tensor_l2_norm / _scale (grad norm without apex)
)


# Modules that use CUDA streams (``_CPUCuda``) on a path that also runs on CPU:
_CUDA_STREAMS = (
    "megatron.core.distributed.param_and_grad_buffer",  # listed above as well
    "megatron.core.transformer.moe.token_dispatcher",  # the alltoall dispatcher of MoE layers
)


def _cuda_factories_to_cpu() -> None:
    cpu_torch = _CPUTorch()
    for name in _HARD_CODED_CUDA + _CUDA_STREAMS:
        importlib.import_module(name).torch = cpu_torch


def _with_cuda_type_names(fn):
    """Runs ``fn`` while ``Tensor.type()`` reports CPU tensors as 'torch.cuda.*Tensor'."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.type

        def cuda_type(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and not self.is_cuda:
                return original(self).replace("torch.", "torch.cuda.", 1)
            return original(self, dtype, non_blocking, **kw)

        torch.Tensor.type = cuda_type
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapper


def _cuda_type_names() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # distrib_optimizer.py: _build_model_and_main_param_groups sorts params by
    # `param.type() in ['torch.cuda.HalfTensor', ...]` / `== 'torch.cuda.FloatTensor'`.
    cls = distrib_optimizer.DistributedOptimizer
    cls._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(cls._build_model_and_main_param_groups.__func__)
    )
    # optimizer.py: Float16OptimizerWithFloat16Params.__init__ makes the same checks.
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _with_cuda_type_names(f16.__init__)
    # clip_grads.py: get_grad_norm_fp32 and clip_grad_by_total_norm_fp32 assert grads
    # are 'torch.cuda.FloatTensor'; optimizer.py imported them by name, so both
    # references are replaced.
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        wrapped = _with_cuda_type_names(getattr(clip_grads, name))
        setattr(clip_grads, name, wrapped)
        setattr(optimizer, name, wrapped)


def _tied_embedding_setup_on_cpu() -> None:
    # models/common/language_module/language_module.py: setup_embeddings_and_output_layer
    # (tied embeddings with PP > 1) zeroes the last stage's copy of the word embedding and
    # all-reduces it over the embedding group (first + last stage) after
    # `weight.data = weight.data.cuda()`; on CPU that call raises "Torch not compiled with
    # CUDA enabled". The all-reduce itself runs on gloo, so `.cuda()` is made the identity
    # for the duration of that method only. The grads are tied later in
    # finalize_model_grads (_allreduce_word_embedding_grads), which needs no shim.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *_, **__: t
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup


def _moe_split_sizes_on_cpu() -> None:
    # transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    # turns the all-to-all split sizes into numpy arrays through moe_utils.maybe_move_tensor_to_cpu
    # (as_numpy=True), which converts only CUDA tensors; CPU tensors stay tensors, and
    # torch.distributed.all_to_all_single (tensor_parallel/mappings.py, _AllToAll) refuses a
    # tensor as split sizes. Reached only with expert parallelism (EP > 1: a real exchange).
    # The dispatcher imported the function by name (0.16 and 0.19), so its reference is replaced.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _uneven_gather_on_gloo() -> None:
    # tensor_parallel/mappings.py, _gather_along_first_dim with output_split_sizes: an
    # all_gather into a list of differently sized tensors. ProcessGroupNCCL takes it (it
    # falls back to one broadcast per rank when the sizes differ); gloo refuses it
    # ("ProcessGroupGloo::allgather: invalid tensor size"). The alltoall token dispatcher
    # calls it over the expert-TP group with each rank's count of routed tokens
    # (token_dispatcher.py, MoEAlltoAllTokenDispatcher.dispatch_postprocess), so TP > 1
    # with EP > 1 reaches it. Here each rank's part is padded to the largest, gathered, and
    # cut back: the same result. Its backward, a reduce_scatter of uneven parts, gloo takes.
    # The layer's autograd function calls the module global (0.16 and 0.19), replaced here.
    from megatron.core.tensor_parallel import mappings

    from areal_mcore import collectives

    original = mappings._gather_along_first_dim

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = collectives.all_gather(padded, group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes, strict=True)])

    mappings._gather_along_first_dim = gather
