"""Slow, obviously-correct twins of the formats layer, for tests only.

Each function loops element by element in IEEE float32 (numpy scalars), so the fast
vectorized paths can be compared bit-exactly against them.
"""

from __future__ import annotations

import numpy as np
import torch


def pack_bits_reference(codes: list[int], bits: int) -> list[int]:
    """Bit-by-bit little-endian stream packing."""
    stream = []
    for c in codes:
        for i in range(bits):
            stream.append((c >> i) & 1)
    while len(stream) % 8:
        stream.append(0)
    return [sum(stream[8 * j + i] << i for i in range(8)) for j in range(len(stream) // 8)]


def quantize_int_reference(xg: torch.Tensor, bits: int, symmetric: bool, clip_ratio: float = 1.0,
                           scale_dtype=torch.float16):
    """Grouped view [G, E] -> (unsigned codes [G, E], stored scales [G], zero points [G])."""
    rows = xg.float().numpy()
    sd = {torch.float16: np.float16, torch.float32: np.float32}[scale_dtype]
    tiny = {torch.float16: 6.2e-5, torch.float32: 1e-30}[scale_dtype]
    codes, scales, zps = [], [], []
    for row in rows:
        if symmetric:
            qmax = 2 ** (bits - 1) - 1
            amax = np.float32(max(abs(float(v)) for v in row)) * np.float32(clip_ratio)
            s = np.float32(amax) / np.float32(qmax)
            s = np.float32(1.0) if s <= 0 else s
            s = np.float32(sd(max(s, np.float32(tiny))))
            q = [int(min(max(np.rint(np.float32(v) / s), -qmax), qmax)) for v in row]
            codes.append([c + 2 ** (bits - 1) for c in q])
            zps.append(0)
        else:
            qmax = 2**bits - 1
            lo = np.float32(min(float(row.min()), 0.0)) * np.float32(clip_ratio)
            hi = np.float32(max(float(row.max()), 0.0)) * np.float32(clip_ratio)
            s = np.float32(hi - lo) / np.float32(qmax)
            s = np.float32(1.0) if s <= 0 else s
            s = np.float32(sd(max(s, np.float32(tiny))))
            z = int(min(max(np.rint(-lo / s), 0), qmax))
            codes.append([int(min(max(np.rint(np.float32(v) / s) + z, 0), qmax)) for v in row])
            zps.append(z)
        scales.append(float(s))
    return (torch.tensor(codes, dtype=torch.int64), torch.tensor(scales, dtype=torch.float32),
            torch.tensor(zps, dtype=torch.int64))


def hadamard_reference(n: int) -> torch.Tensor:
    """H_n by the Sylvester recursion H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
