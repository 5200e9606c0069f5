"""Which path a kernel takes: Triton or pure torch, by its config value (``KERNEL_CHOICES``)."""

from __future__ import annotations

import functools
import importlib

import torch

# "auto": Triton when CUDA is present and triton imports, the torch path otherwise.
KERNEL_CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install that fails on import
        return False
    return True


def use_triton(kernel: str, key: str) -> bool:
    """Whether the config value ``kernel`` (of config key ``key``) selects Triton."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"{key}={kernel!r} is not allowed; choose one of {list(KERNEL_CHOICES)}")
    if kernel == "auto":
        return torch.cuda.is_available() and triton_available()
    if kernel == "triton" and not triton_available():
        raise ValueError(f"{key}=triton but triton does not import; `pip install triton` "
                         f"or set {key}=auto (the torch path on machines without it)")
    return kernel == "triton"


def check_runnable(kernel_fn, device: torch.device, key: str) -> None:
    """Compiled Triton kernels need CUDA tensors; the interpreter also takes CPU ones."""
    from triton.runtime.interpreter import InterpretedFunction

    if device.type != "cuda" and not isinstance(kernel_fn, InterpretedFunction):
        raise ValueError(f"{key}=triton needs CUDA tensors (got {device}); set "
                         f"{key}=auto or torch on CPU (TRITON_INTERPRET=1 runs the kernels "
                         "on CPU through Triton's interpreter, for tests)")
