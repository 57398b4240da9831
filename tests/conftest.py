"""Test-session settings shared by every test module."""

import torch

# The tests run tiny models whose ops are too small to gain from intra-op threads; on a shared CPU
# extra threads only add synchronisation stalls (seen here: 20-40x slower small ops under load).
torch.set_num_threads(1)
