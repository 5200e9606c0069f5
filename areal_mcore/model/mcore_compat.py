"""The megatron-core versions areal-mcore runs on, and where their differences are handled.

Tested range (setup.py, ``make test`` runs the megatron tests at both ends): 0.16.1 on
Python 3.11 and 0.19.2 on Python 3.12 (0.17+ ships cp312 wheels only; NVIDIA's containers
carry 0.17+). Code that behaves differently across that range asks ``at_least`` here, and
each such branch names the megatron-core version and call site it depends on. Two things
differ so far: the CPU shims (``cpu_shims.py``: CUDA-only calls that 0.19 added on the CPU
path), which checkpoints a version can resume (``resume_refusal``) and the MoE router
without TransformerEngine (``define_moe_te_gemm``). The actor,
checkpoint and conversion code otherwise uses APIs that are the same on every tested version.
"""

from __future__ import annotations

import re
import warnings

from megatron.core import package_info

# (major, minor, patch) of the installed megatron-core, e.g. (0, 19, 2).
MCORE_VERSION: tuple[int, int, int] = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
# Built from the parts, not ``megatron.core.__version__``: 0.19's package_info.py appends
# ``+<git HEAD>`` of whatever git checkout holds site-packages (it runs ``git rev-parse``
# in its own folder), so a venv inside a project checkout reports the *project's* commit.
MCORE_VERSION_STR: str = ".".join(map(str, MCORE_VERSION)) + package_info.PRE_RELEASE
TESTED_MIN, TESTED_BELOW = (0, 16, 1), (0, 20, 0)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.2"``, ``"0.19.2+f8f4eb2"``, ``"0.20.0rc1"`` -> (major, minor, patch)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a megatron-core version: {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def resume_refusal(saved: str) -> str | None:
    """Why a checkpoint saved under megatron-core ``saved`` cannot be resumed here, or None.

    Measured (tests/test_mcore_versions.py): 0.19.2 resumes a 0.16.1 checkpoint exactly
    (bitwise the same run), but 0.16.1 cannot load one saved by 0.19.2: 0.19's
    dist_checkpointing keeps the common (non-tensor) state inside the torch_dist files and
    writes no ``common.pt``, which 0.16.1's ``strategies/common.py::load_common`` opens
    unconditionally. So a checkpoint from a newer minor version than this one is refused.
    The HF exporter reads both (it reads the torch_dist tensors directly).
    """
    if parse_version(saved)[:2] <= MCORE_VERSION[:2]:
        return None
    return (f"it was saved by megatron-core {saved} and this run has megatron-core "
            f"{MCORE_VERSION_STR}, which cannot load checkpoints of a newer megatron-core "
            f"(0.19 writes no common.pt). Resume under megatron-core>="
            f"{'.'.join(map(str, parse_version(saved)[:2]))}, or export the checkpoint to HF "
            f"(areal-mcore convert mcore-to-hf reads both) and start from the export")


def at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the installed megatron-core is ``major.minor.patch`` or newer."""
    return MCORE_VERSION >= (major, minor, patch)


def warn_if_untested() -> None:
    """Warns (once per process) when megatron-core lies outside the tested range.

    pip keeps the range of setup.py, but a container may carry another version installed
    with ``--no-deps``; it may work, and the warning says what was tested.
    """
    if not TESTED_MIN <= MCORE_VERSION < TESTED_BELOW:
        warnings.warn(
            f"megatron-core {MCORE_VERSION_STR} is outside the tested range "
            f">={'.'.join(map(str, TESTED_MIN))},<{'.'.join(map(str, TESTED_BELOW))}",
            stacklevel=2,
        )


def define_moe_te_gemm() -> None:
    """Makes megatron-core 0.16's MoE router run without TransformerEngine.

    transformer/moe/moe_utils.py imports ``te_general_gemm`` only when TE imports and, in
    0.16.1, defines no fallback, so ``RouterGatingLinearFunction.forward`` (every MoE
    router's logits) raises NameError without TE. 0.19 sets it to None there, which selects
    its plain ``torch.mm`` branch; this does the same where the name is missing.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
