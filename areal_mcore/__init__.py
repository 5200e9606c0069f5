"""areal-mcore: the AReaL v0.2 "boba" RL recipe on a megatron-core actor."""

__version__ = "0.1.0"
