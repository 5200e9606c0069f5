"""Measures the activation memory of a forward/backward: the peak bytes autograd holds.

"Activations" are what autograd saves for the backward (``save_for_backward`` inputs of
every op and of megatron's autograd Functions, incl. its recompute checkpoints), counted
per storage (a view holds its whole storage alive) from the moment they are saved until
the graph frees them, excluding the parameters (model state, planned separately).
This is independent of the allocator, so it reads the same on CPU, where torch keeps no
memory statistics and RSS moves with glibc's caching, and on GPU (where
``torch.cuda.max_memory_allocated`` additionally sees transient buffers).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Saved:
    """One saved tensor; its destruction (when autograd drops the graph) releases it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedActivationMeter, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter._release(self.key)


class SavedActivationMeter:
    """Context manager: ``peak_bytes`` of tensors saved for backward while it is active.

    Args:
        exclude: tensors whose storages are not activations (the model's parameters).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, saved references]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._skip:
            return t
        entry = self._live.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[key]
