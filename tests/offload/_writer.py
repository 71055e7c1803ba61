"""Subprocess for the kill -9 test: put blocks forever, print each key once put returned."""

import sys

import torch

torch.set_num_threads(1)

from lessmem.offload import DiskTier  # noqa: E402

tier = DiskTier(sys.argv[1])
i = 0
while True:
    key = f"blk{i:06d}"
    tier.put(key, {"x": torch.full((20000,), float(i)), "i": torch.tensor([i])})
    print(key, flush=True)
    i += 1
