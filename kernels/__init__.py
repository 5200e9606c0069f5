"""Triton kernels (fused vocab-parallel logprob/entropy, packed GAE), installed as
``areal_mcore.kernels``. Empty until the kernels issue lands."""
