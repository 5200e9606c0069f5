"""areal-mcore: the AReaL v0.2 "boba" RL recipe on a megatron-core actor."""

from areal_mcore.model import eager_fusions as _eager_fusions

__version__ = "0.1.0"

# Before any module of ours imports megatron-core: on CPU its fusions stay eager
# (model/eager_fusions.py); imports nothing itself.
_eager_fusions.install()
