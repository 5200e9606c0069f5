"""Run-time detection of optional GPU accelerators.

TransformerEngine (TE layer spec, fused attention) and NVIDIA apex (fused Adam,
fused RMSNorm) come with NVIDIA's PyTorch containers; apex is not on PyPI. The actor
uses them when they import and CUDA is present, and falls back to megatron-core's local
spec and torch's AdamW otherwise.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerators:
    cuda: bool
    transformer_engine: bool
    apex: bool

    def describe(self) -> str:
        def on(flag: bool) -> str:
            return "yes" if flag else "no (fallback)"

        return (
            f"cuda={'yes' if self.cuda else 'no'}, "
            f"transformer_engine={on(self.transformer_engine)}, apex={on(self.apex)}"
        )


def _imports(module: str) -> bool:
    # A real import, not find_spec: TE and apex are installed in some CPU images but fail
    # to import without their CUDA libraries, and that must count as "absent".
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, OSError from missing .so files, RuntimeError from TE
        return False
    return True


@functools.cache
def detect() -> Accelerators:
    """What this process can use; cached because imports are slow and do not change."""
    cuda = torch.cuda.is_available()
    return Accelerators(
        cuda=cuda,
        transformer_engine=cuda and _imports("transformer_engine.pytorch"),
        apex=cuda and _imports("apex.optimizers"),
    )
