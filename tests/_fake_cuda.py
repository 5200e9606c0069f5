"""A CUDA device emulated on CPU tensors, and an NCCL-like group, for placement tests.

Inside ``FakeCuda()``, tensors created with ``device="cuda"`` (or moved there) are CPU
tensors tagged as CUDA: ``.device`` says ``cuda:0``, ``.to("cpu")`` drops the tag, and an
op that mixes tagged and untagged tensors (other than CPU scalars, indices and copies,
which real CUDA allows too) raises as CUDA would. ``nccl_like(monkeypatch, group)`` makes
``group`` serve CUDA only: its collectives refuse untagged tensors with NCCL's message,
then run on gloo (the data is on the CPU underneath), so values stay checkable.

``FakeCuda().syncs`` logs each call that would block the host until the GPU caught up:
reading an emulated tensor's values (``.tolist()``, ``.item()``, ``int()``/``float()``/
``bool()``, ``torch.equal``, a copy to the CPU), and a host-to-device copy that is blocking
(aten/src/ATen/native/cuda/Copy.cu::copy_kernel_cuda runs ``memcpy_and_sync``) or
from pageable memory (the CUDA runtime "may synchronize with the stream" to stage it: the
API synchronization behaviour notes), i.e. any but ``pin_memory().to(..., non_blocking=True)``.
``torch.equal`` of two views of the same memory is free, as in
aten/src/ATen/native/cuda/Equal.cpp::cuda_equal.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_TAG = "_fake_cuda"
# Real CUDA takes CPU index tensors and copies between devices.
_MIXED_OK = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_,
             torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
             torch._has_compatible_shallow_copy_type}  # a type query (Module._apply asks it before a move)


_TENSOR_TYPE = torch.Tensor.type  # the C method (cpu_shims swaps the attribute for a while)
_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__}
_PINNED = "_fake_pinned"


def is_fake_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _tag(t):
    if isinstance(t, torch.Tensor):
        setattr(t, _TAG, True)
    return t


def _is_cuda(device) -> bool:
    # A bare int is a CUDA index (megatron passes torch.cuda.current_device()); torch.device(0)
    # itself raises on a CPU-only build ("Cannot access accelerator device").
    return device is not None and not isinstance(device, (torch.dtype, bool)) and \
        (isinstance(device, int) or isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda")


def _aliases(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a.storage_offset() == b.storage_offset() and a.stride() == b.stride() and a.dtype == b.dtype


def _sync(func, args, kwargs) -> str | None:
    """Why ``func`` would block the host on a real GPU, or None."""
    name = getattr(func, "__name__", str(func))
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func in _READS and is_fake_cuda(src):
        return name
    if func is torch.equal and (is_fake_cuda(args[0]) or is_fake_cuda(args[1])) and not _aliases(*args[:2]):
        return name
    dest = kwargs.get("device", args[1] if func is torch.Tensor.to and len(args) > 1 else None)
    if not isinstance(dest, (str, torch.device, int)) or isinstance(dest, bool):
        dest = None  # .to(dtype)
    to_cuda = func is torch.Tensor.cuda or (dest is not None and _is_cuda(dest))
    if is_fake_cuda(src) and (func is torch.Tensor.cpu or (func is torch.Tensor.to and dest is not None and not to_cuda)):
        return f"{name} to the CPU"
    pinned = getattr(src, _PINNED, False)
    if func in (torch.Tensor.to, torch.Tensor.cuda) and to_cuda and src is not None and not is_fake_cuda(src) \
            and not (kwargs.get("non_blocking") and pinned):
        return f"{name} from {'pinned' if pinned else 'pageable'} memory to the device"
    if func in (torch.tensor, torch.as_tensor) and to_cuda:
        return f"{name} on the device (a blocking copy)"
    return None


class FakeCuda(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []  # see the module's docstring

    def __enter__(self):
        # nn.Parameter(t) is a new Python object made by Tensor._make_subclass, which no
        # torch-function mode sees (torch/nn/parameter.py): it would drop the tag, and every
        # module built on the device would look like a CPU one. A parameter of a tagged
        # tensor is tagged here (restored on exit).
        self._parameter_new = torch.nn.Parameter.__dict__["__new__"]
        real = self._parameter_new.__func__

        def new(cls, data=None, requires_grad=True):
            return _tag(real(cls, data, requires_grad)) if is_fake_cuda(data) else real(cls, data, requires_grad)
        torch.nn.Parameter.__new__ = staticmethod(new)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.Parameter.__new__ = self._parameter_new
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (why := _sync(func, args, kwargs)) is not None:
            self.syncs.append(why)
        if func is torch.Tensor.pin_memory:  # no CUDA underneath: a copy marked page-locked
            out = args[0].clone()
            setattr(out, _PINNED, True)
            return out
        if func == torch.Tensor.device.__get__:  # a new method-wrapper per access: compare, not "is"
            return CUDA if is_fake_cuda(args[0]) else func(*args)
        if func == torch.Tensor.is_cuda.__get__:  # megatron branches on it (moe_utils, optimizer)
            return is_fake_cuda(args[0]) or func(*args)
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs and is_fake_cuda(args[0]):
            # megatron's optimizers sort parameters by 'torch.cuda.FloatTensor' names
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func == torch.Tensor.data.__set__:  # `param.data = t` (Module.to, megatron's DDP buffers): a move
            func(*args)
            setattr(args[0], _TAG, is_fake_cuda(args[1]))
            return None
        target = None  # "cuda" / "cpu" when the call places its result
        if kwargs.get("device") is not None:
            target = "cuda" if _is_cuda(kwargs["device"]) else "cpu"
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            target = "cuda" if _is_cuda(args[1]) else "cpu"
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.cuda:
            func, args, kwargs, target = torch.Tensor.clone, args[:1], {}, "cuda"
        if func is torch.Tensor.cpu:
            target = "cpu"
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fake = any(map(is_fake_cuda, tensors))
        if fake and func not in _MIXED_OK:
            plain = [t for t in tensors if not is_fake_cuda(t) and t.dim() > 0]
            if plain:
                raise RuntimeError(f"{getattr(func, '__name__', func)}: expected all tensors to be on the same "
                                   f"device, but found cuda:0 and cpu (shape {tuple(plain[0].shape)})")
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS:
            return out  # in place: the destination keeps its device
        if target is None and func in (torch.Tensor.to, torch.Tensor.cpu):
            target = "cuda" if fake else "cpu"  # .to(dtype): same device
        if target is None:
            target = "cuda" if fake else "cpu"
        if isinstance(out, torch.Tensor) and tensors and out is tensors[0] and \
                is_fake_cuda(out) != (target == "cuda"):
            out = out.clone()  # a move makes a new tensor; torch returned the input itself
        tree_map(lambda t: setattr(t, _TAG, target == "cuda") if isinstance(t, torch.Tensor) else t, out)
        return out


def nccl_like(setattr_, group) -> list[str]:
    """Makes ``group`` a CUDA-only (NCCL-like) group; returns a log of its collectives.
    ``setattr_`` is ``monkeypatch.setattr`` (or plain ``setattr`` in a spawned rank)."""
    log: list[str] = []
    real_config = dist.get_backend_config
    setattr_(dist, "get_backend_config", lambda g=None: "cuda:nccl" if g is group else real_config(g))
    setattr_(torch.cuda, "current_device", lambda: 0)
    for name in ("all_reduce", "broadcast", "all_gather", "gather", "send", "recv"):
        real = getattr(dist, name)

        def checked(*args, _real=real, _name=name, **kwargs):
            if kwargs.get("group") is group:
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                if not all(map(is_fake_cuda, tensors)):
                    raise RuntimeError("No backend type associated with device type cpu")
                log.append(_name)
                if kwargs.get("async_op"):
                    return NcclWork(_real(*args, **kwargs), log)
            return _real(*args, **kwargs)
        setattr_(dist, name, checked)
    return log


class NcclWork:
    """An async collective's Work as NCCL's behaves (ProcessGroupNCCL.cpp): ``is_completed``
    polls (``WorkNCCL::isCompleted``: the end event, the communicator's error); ``wait()``
    of a pending work returns at once (the current stream waits, not the host); a completed
    one raises its error, if any. ``wait(timeout)`` blocks and at the bound aborts the
    communicator, which the watchdog may see first and end the process with: logged as
    "wait(timeout)", then gloo's wait with the same bound."""

    def __init__(self, work, log: list[str]):
        self._work, self._log = work, log

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            self._log.append("wait(timeout)")
            return self._work.wait(timeout)
        return self._work.wait() if self._work.is_completed() else True


class CountingCuda(FakeCuda):
    """``FakeCuda`` that also counts the emulated device's memory: the bytes of every
    storage a live emulated tensor holds (views share their base's), and their ``peak``
    since ``reset_peak()``, sampled at each new emulated tensor (an allocation)."""

    def __init__(self):
        super().__init__()
        self._held: dict[int, tuple[int, list[weakref.ref]]] = {}  # storage address: bytes, holders
        self.peak = 0

    def live(self) -> int:
        return sum(n for n, holders in self._held.values() if any(h() is not None for h in holders))

    def reset_peak(self) -> None:
        self.peak = self.live()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        new = [t for t in tree_flatten(out)[0] if is_fake_cuda(t)]
        for t in new:
            storage = t.untyped_storage()
            entry = self._held.get(storage.data_ptr())
            if entry is None or all(h() is None for h in entry[1]):  # new (or a freed one's address)
                entry = self._held[storage.data_ptr()] = (storage.nbytes(), [])
            entry[1].append(weakref.ref(t))
        if new:
            self.peak = max(self.peak, self.live())
        return out
