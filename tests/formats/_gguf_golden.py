"""Platform-independent test input for the GGUF golden hashes.

Every value is an integer times a power of two, built with integer arithmetic only,
so the float32 array is identical on every machine and numpy version.
"""

from __future__ import annotations

import numpy as np


def golden_input() -> np.ndarray:
    """[8, 1024] float32: ~Gaussian rows, outliers, a zero row, a constant row, a positive row."""
    n = 8 * 1024 * 4
    i = np.arange(n, dtype=np.uint64)
    u = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)
    u = (u ^ (u >> np.uint64(13))) * np.uint64(1103515245) % np.uint64(2**32)
    u = (u >> np.uint64(16)).astype(np.int64).reshape(8, 1024, 4)  # 16-bit uniforms
    # sum of 4 uniforms, centred: approx Gaussian, std ~ 1 after the 2^-15 scaling
    g = (u.sum(axis=-1) - 2 * 65535).astype(np.float32) * np.float32(2.0**-15)
    x = g.copy()
    x[1, ::97] *= np.float32(64)  # outliers
    x[2] = 0
    x[3] = np.float32(0.75)
    x[4] = np.abs(x[4]) + np.float32(0.5)  # all positive
    x[5, :512] = 0  # half-zero row: zero blocks next to normal ones
    x[6] *= np.float32(2.0**-20)  # tiny values
    return x


def golden_imatrix() -> np.ndarray:
    """[1024] float32 importance weights: small exact values, some zero columns."""
    j = np.arange(1024)
    w = ((j * 37) % 17 + 1).astype(np.float32) / np.float32(8)
    w[j % 29 == 0] = 0
    return w
