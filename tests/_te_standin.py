"""megatron's TransformerEngine layer spec built on CPU: TE's modules stood in by CPU
modules that register TE's parameter names.

``get_gpt_layer_with_transformer_engine_spec`` asks its backend (``TESpecProvider``) for
the modules; this provider answers with megatron's local modules, except for TE's
``LayerNormLinear``, whose stand-in fuses an RMSNorm in front of the linear and registers
its weight as TE does (``layer_norm_weight``: transformer_engine/pytorch/module/
layernorm_linear.py). The layer structure (which norms are ``IdentityOp``, which linears
carry the norm) is megatron's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear

from areal_mcore.model.attention import CPUCoreAttention
from areal_mcore.model.norm import SequenceParallelRMSNorm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon

    def forward(self, x):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps))


class CpuTESpecProvider(LocalSpecProvider):
    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return LayerNormColumnParallelLinear

    def core_attention(self):
        return CPUCoreAttention

    # has_residual: megatron-core 0.19 asks it of an MoE layer's pre-MLP norm (models/backends.py)
    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return SequenceParallelRMSNorm


@contextlib.contextmanager
def te_spec_on_cpu():
    """megatron's TE spec builds with the CPU stand-ins while inside."""
    from megatron.core.models.gpt import gpt_layer_specs

    had = hasattr(gpt_layer_specs, "TESpecProvider")
    old = getattr(gpt_layer_specs, "TESpecProvider", None)
    gpt_layer_specs.TESpecProvider = CpuTESpecProvider
    try:
        yield
    finally:
        if had:
            gpt_layer_specs.TESpecProvider = old
        else:
            del gpt_layer_specs.TESpecProvider
