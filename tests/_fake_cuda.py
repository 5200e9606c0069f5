"""A CUDA device emulated on CPU tensors, and an NCCL-like group, for placement tests.

Inside ``FakeCuda()``, tensors created with ``device="cuda"`` (or moved there) are CPU
tensors tagged as CUDA: ``.device`` says ``cuda:0``, ``.to("cpu")`` drops the tag, and an
op that mixes tagged and untagged tensors (other than CPU scalars, indices and copies,
which real CUDA allows too) raises as CUDA would. ``nccl_like(monkeypatch, group)`` makes
``group`` serve CUDA only: its collectives refuse untagged tensors with NCCL's message,
then run on gloo (the data is on the CPU underneath), so values stay checkable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_TAG = "_fake_cuda"
# Real CUDA takes CPU index tensors and copies between devices.
_MIXED_OK = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_,
             torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}


def is_fake_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _tag(t):
    if isinstance(t, torch.Tensor):
        setattr(t, _TAG, True)
    return t


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, torch.dtype) and \
        isinstance(device, (str, torch.device, int)) and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:  # a new method-wrapper per access: compare, not "is"
            return CUDA if is_fake_cuda(args[0]) else func(*args)
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
            return _real(*args, **kwargs)
        setattr_(dist, name, checked)
    return log
