"""Compiles every Triton kernel variant to a Hopper (sm_90) cubin, no GPU needed.

Triton's interpreter runs kernels as numpy and accepts code its compiler rejects (types of
loop-carried values, scalar/block mixes), so the CPU tests alone would not catch a kernel
that fails on a GPU. Run as a script in a process without TRITON_INTERPRET (the kernels
must be defined as JIT functions); prints one line per variant.
"""

import os

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from areal_mcore.kernels import _logprob_triton, gae  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
LOGITS = {"logits_ptr": "*bf16", "stride_t": "i32"}
SHAPE = {"T": "i32", "V": "i32", "start": "i32", "vocab_size": "i32", "temperature": "fp32"}
TILE = {"BLOCK_T": _logprob_triton.BLOCK_T, "BLOCK_V": _logprob_triton.BLOCK_V}


def compile_one(fn, types: dict, constexprs: dict) -> None:
    signature = {**types, **dict.fromkeys(constexprs, "constexpr")}
    assert list(signature) == fn.arg_names, (list(signature), fn.arg_names)
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=TARGET, options={"num_warps": 8})
    assert kernel.asm["cubin"]
    print(fn.__name__, constexprs, "ok")


compile_one(_logprob_triton._partials_kernel,
            {**LOGITS, "targets_ptr": "*i64", "out_ptr": "*fp32", **SHAPE}, TILE)
for has_logp, has_ent in ((True, True), (True, False), (False, True)):
    compile_one(_logprob_triton._grad_kernel,
                {**LOGITS, "grad_ptr": "*bf16", "stride_gt": "i32", "targets_ptr": "*i64",
                 "lse_ptr": "*fp32", "mean_z_ptr": "*fp32", "g_logp_ptr": "*fp32",
                 "g_ent_ptr": "*fp32", **SHAPE},
                {"HAS_LOGP": has_logp, "HAS_ENT": has_ent, **TILE})
for has_values in (True, False):
    for has_mask in (True, False):
        compile_one(gae._gae_kernel,
                    {"rewards_ptr": "*fp32", "cu_ptr": "*i64", "values_ptr": "*fp32",
                     "mask_ptr": "*i8", "adv_ptr": "*fp32", "ret_ptr": "*fp32", "coef_ptr": "*fp64"},
                    {"HAS_VALUES": has_values, "HAS_MASK": has_mask})
