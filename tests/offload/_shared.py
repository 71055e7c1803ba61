"""Subprocess for the shared-directory tests: one of several processes on one store.

argv: store-dir capacity prefix count other-prefix. Puts ``count`` blocks under
``<prefix><i>`` into a DiskTier of that capacity while reading the other process's
blocks (which either may evict: a lost block must read as a miss, never an error);
prints "ok <hits> <misses> <wrong>" at the end.
"""

import sys

import torch

torch.set_num_threads(1)

from lessmem.offload import DiskTier  # noqa: E402

path, cap, prefix, count, other = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
tier = DiskTier(path, capacity=cap, fsync=False)
hits = misses = wrong = 0
for i in range(count):
    tier.put(f"{prefix}{i}", {"x": torch.full((1000,), float(i)), "i": torch.tensor([i])})
    keys = [f"{other}{j}" for j in range(max(0, i - 6), i)]
    got = tier.get_many(keys) if i % 2 else [tier.get(k) for k in keys]
    for k, b in zip(keys, got, strict=True):
        if b is None:
            misses += 1
        else:
            j = int(k[len(other):])
            hits += 1
            wrong += not (b["i"].item() == j and torch.equal(b["x"], torch.full((1000,), float(j))))
print("ok", hits, misses, wrong, flush=True)
