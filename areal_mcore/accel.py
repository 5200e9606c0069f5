"""Run-time detection of optional GPU accelerators.

TransformerEngine (TE layer spec, fused attention) and NVIDIA apex (fused Adam,
fused RMSNorm) come with NVIDIA's PyTorch containers; apex is not on PyPI. The actor
uses them when they import and CUDA is present, and falls back to megatron-core's local
spec and torch's AdamW otherwise.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerators:
    cuda: bool
    transformer_engine: bool
    apex: bool
    # apex's CUDA extension for gradient_accumulation_fusion (a separate build option)
    wgrad_fusion: bool = False

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
        wgrad_fusion=cuda and _imports("fused_weight_gradient_mlp_cuda"),
    )


def wgrad_fusion(setting: str, found: Accelerators) -> bool:
    """Whether to turn on megatron's ``gradient_accumulation_fusion`` (``actor.
    gradient_accumulation_fusion``: auto, true or false).

    megatron's ``ColumnParallelLinear`` raises at construction when it is on and apex's
    ``fused_weight_gradient_mlp_cuda`` extension does not import (tensor_parallel/
    layers.py), and the output layer is one under TransformerEngine's spec too: TE alone
    is not enough, the extension is what it needs."""
    if setting == "true" and not found.wgrad_fusion:
        raise ValueError("actor.gradient_accumulation_fusion=true needs apex's fused_weight_gradient_mlp_cuda "
                         "extension with CUDA (megatron's ColumnParallelLinear, the output layer under either "
                         "layer spec, raises without it); use auto or false")
    return found.wgrad_fusion if setting == "auto" else setting == "true"


# Known noise from megatron-core at every rank's start and first step, each a warning with
# its source line: its accelerator fallbacks (six warnings when TE/apex are missing; what
# they say is the one line `fallbacks` returns), its own default cuda_graph_scope ("full",
# deprecated by itself), its DistributedOptimizer reading `.grad` of a non-leaf tensor, and
# its grad buffers calling the collectives torch 2.13 deprecated
# (megatron/core/distributed/param_and_grad_buffer.py).
_KNOWN_WARNINGS = (
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     FutureWarning),
)


def quiet_known_warnings() -> None:
    """Filters megatron-core's known start-up warnings (call before importing it)."""
    for pattern, category in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def fallbacks(found: Accelerators) -> str | None:
    """One line naming the missing accelerators and what runs instead; None if none is."""
    missing = [what for what, ok in (
        ("TransformerEngine (layer spec, fused attention: megatron's local spec instead)",
         found.transformer_engine),
        ("apex (fused Adam and RMSNorm: torch's instead)", found.apex)) if not ok]
    if not missing:
        return None
    why = "" if found.cuda else "no CUDA, so "
    return f"accelerators: {why}not using " + "; ".join(missing)
