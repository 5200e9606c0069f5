import os

import torch

# Deterministic, and no oversubscription of the 2-core CI machine.
torch.manual_seed(0)
torch.set_num_threads(1)

# Without a GPU the Triton kernels (kernels/) run on CPU tensors through Triton's
# interpreter. triton.jit reads TRITON_INTERPRET when a kernel is *defined*, i.e. when its
# module is first imported, so it is set here, before any test module imports one; the
# spawned gloo ranks inherit it. Production code never sets it ("auto" picks torch on CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# Same examples on every run (CI must be deterministic); no example database on disk.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")
