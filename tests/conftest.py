import torch

# Deterministic, and no oversubscription of the 2-core CI machine.
torch.manual_seed(0)
torch.set_num_threads(1)
