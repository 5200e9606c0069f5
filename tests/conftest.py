import torch

# Deterministic, and no oversubscription of the 2-core CI machine.
torch.manual_seed(0)
torch.set_num_threads(1)

from hypothesis import settings  # noqa: E402

# Same examples on every run (CI must be deterministic); no example database on disk.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")
