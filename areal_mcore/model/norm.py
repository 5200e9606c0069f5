"""RMSNorm for the local layer spec that works under megatron's sequence parallelism.

megatron's local spec builds its norms with ``WrappedTorchNorm`` (transformer/torch_norm.py),
which asserts ``not config.sequence_parallel``. The reason is the gradient, not the forward:
under SP each TP rank normalises a different slice of the tokens, so a norm weight's
gradient on one rank is a *partial* sum, and megatron completes it only for parameters
marked ``param.sequence_parallel = True`` (distributed/finalize_model_grads.py,
``_allreduce_non_tensor_model_parallel_grads``: SUM over the TP group). TE's ``TENorm`` and
apex's ``FusedLayerNorm`` set that mark; torch's RMSNorm does not. This class is torch's
RMSNorm plus the mark, so it is a spec choice (used on GPU without TE too), not a CPU shim.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose weight megatron all-reduces over TP under SP."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm"):
        # Same constructor as WrappedTorchNorm (build_module passes these keywords).
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm implements plain RMSNorm only")
        # In the model's dtype, as megatron's other parameters (and TE's norms) are: an fp32
        # weight beside bf16 activations keeps torch's RMSNorm off its fused kernel.
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
