import torch

# Tiny models: one thread is fastest and keeps the shared 2-core machine responsive.
torch.set_num_threads(1)
