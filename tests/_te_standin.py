"""megatron's TransformerEngine layer spec built on CPU: TE's modules stood in by CPU
modules that register TE's parameter names.

``get_gpt_layer_with_transformer_engine_spec`` asks its backend (``TESpecProvider``) for
the modules; this provider answers with megatron's local modules, except for
- TE's ``LayerNormLinear``, whose stand-in fuses an RMSNorm in front of the linear and
  registers its weight as TE does (``layer_norm_weight``: transformer_engine/pytorch/module/
  layernorm_linear.py);
- TE's ``GroupedLinear`` under megatron's real TEGroupedMLP (grouped-GEMM experts): the
  stand-in registers one ``weight{i}`` per local expert, as TE does (grouped_linear.py), and
  multiplies each expert's rows by its own weight.
The layer structure (which norms are ``IdentityOp``, which linears carry the norm, the
experts' activation and probabilities) is megatron's own. Not stood in: TE's
``sharded_state_dict`` of GroupedLinear (megatron's TEGroupedLinear._sharded_state_dict_grouped
gives it SequentialMLP's checkpoint keys), so checkpoint keys of grouped experts are not
compared here.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import experts

from areal_mcore.model.attention import CPUCoreAttention
from areal_mcore.model.norm import SequenceParallelRMSNorm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon

    def forward(self, x):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps))


class _GroupedLinear(torch.nn.Module):
    """megatron's TEGroupedLinear for experts: the expert-TP split is taken here and TE runs
    without communication (``explicit_expert_comm``; the token dispatcher communicates)."""

    parallel_mode = ""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        assert is_expert and not bias
        tp = pg_collection.expt_tp.size()
        if self.parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(weight)
            weight.allreduce = config.expert_model_parallel_size == 1  # as TEGroupedLinear sets it
            self.register_parameter(f"weight{i}", weight)
        self.num_gemms = num_gemms

    def forward(self, x, m_splits):
        parts = x.split(m_splits)
        return torch.cat([p @ getattr(self, f"weight{i}").t() for i, p in enumerate(parts)]), None


class ColumnParallelGroupedLinear(_GroupedLinear):
    parallel_mode = "column"


class RowParallelGroupedLinear(_GroupedLinear):
    parallel_mode = "row"


class CpuTESpecProvider(LocalSpecProvider):
    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return LayerNormColumnParallelLinear

    def core_attention(self):
        return CPUCoreAttention

    # megatron-core 0.16 asks (grouped, legacy) for (module, MLPSubmodules); 0.19 asks
    # (grouped) for a partial of the module with GroupedMLPSubmodules (models/backends.py).
    def grouped_mlp_modules(self, moe_use_grouped_gemm, *legacy):
        if not moe_use_grouped_gemm:
            return super().grouped_mlp_modules(False, *legacy)
        fc = dict(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)
        if not legacy:
            return functools.partial(experts.TEGroupedMLP, submodules=experts.GroupedMLPSubmodules(**fc))
        return experts.TEGroupedMLP, MLPSubmodules(**fc)

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
