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


def _round_up(s, sd):
    """Smallest value of numpy dtype ``sd`` that is >= the float32 ``s``."""
    r = sd(s)
    if np.float32(r) < np.float32(s):
        r = np.nextafter(r, sd(np.inf))
    return np.float32(r)


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
            s = _round_up(max(s, np.float32(tiny)), sd)
            z = int(min(max(np.rint(-lo / s), 0), qmax))
            codes.append([int(min(max(np.rint(np.float32(v) / s) + z, 0), qmax)) for v in row])
            zps.append(z)
        scales.append(float(s))
    return (torch.tensor(codes, dtype=torch.int64), torch.tensor(scales, dtype=torch.float32),
            torch.tensor(zps, dtype=torch.int64))


def quantize_superblock_reference(xg: torch.Tensor, bits: int, symmetric: bool, subs: int,
                                  sub_scale_bits: int):
    """SuperBlock integer quantization, one super-block (``subs`` rows of xg) at a time.

    Per sub-block scale s as in :func:`quantize_int_reference` (fp16); per super-block
    d = max(s) / (2^k - 1) rounded *up* to fp16; sub-scale codes c = ceil(s/d - 1e-6) in
    [1, 2^k - 1]; effective scale c·d. Returns (codes [G, E], effective scales [G],
    zero points [G], sub-scale codes [G], super-block scales [G / subs]).
    """
    _, scales, _ = quantize_int_reference(xg, bits, symmetric)
    smax = 2**sub_scale_bits - 1
    rows = xg.float().numpy()
    codes, effs, zps, subc, ds = [], [], [], [], []
    for b in range(rows.shape[0] // subs):
        block = scales[b * subs:(b + 1) * subs].tolist()
        d = max(np.float32(max(np.float32(v) for v in block) / np.float32(smax)), np.float32(6.2e-5))
        d = _round_up(d, np.float16)
        ds.append(float(d))
        for j, s in enumerate(block):
            c = int(min(max(np.ceil(np.float32(s) / d - np.float32(1e-6)), 1), smax))
            eff = np.float32(np.float32(c) * d)
            row = rows[b * subs + j]
            if symmetric:
                qmax = 2 ** (bits - 1) - 1
                codes.append([int(min(max(np.rint(np.float32(v) / eff), -qmax), qmax)) + qmax + 1
                              for v in row])
                zps.append(0)
            else:
                qmax = 2**bits - 1
                lo = np.float32(min(float(row.min()), 0.0))
                z = int(min(max(np.rint(-lo / eff), 0), qmax))
                codes.append([int(min(max(np.rint(np.float32(v) / eff) + z, 0), qmax)) for v in row])
                zps.append(z)
            subc.append(c)
            effs.append(float(eff))
    return (torch.tensor(codes, dtype=torch.int64), torch.tensor(effs, dtype=torch.float32),
            torch.tensor(zps, dtype=torch.int64), torch.tensor(subc, dtype=torch.int64),
            torch.tensor(ds, dtype=torch.float32))


def hadamard_reference(n: int) -> torch.Tensor:
    """H_n by the Sylvester recursion H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# --- FP8 -------------------------------------------------------------------------------
# (exponent bits, mantissa bits, bias, special-value convention), written out from the
# format definitions independently of formats/fp8.py
FP8_LAYOUTS = {
    "e4m3fn": (4, 3, 7, "fn"),  # only S.1111.111 is NaN, no inf
    "e4m3fnuz": (4, 3, 8, "fnuz"),  # only 0x80 is NaN, no inf, no -0
    "e5m2": (5, 2, 15, "ieee"),  # top exponent: inf / NaN
    "e5m2fnuz": (5, 2, 16, "fnuz"),
}


def fp8_decode_reference(byte: int, variant: str) -> float:
    """Value of one fp8 bit pattern (NaN / ±inf where the format says so)."""
    e_bits, m_bits, bias, kind = FP8_LAYOUTS[variant]
    sign = -1.0 if byte >> 7 else 1.0
    e = (byte >> m_bits) & ((1 << e_bits) - 1)
    f = byte & ((1 << m_bits) - 1)
    if kind == "fnuz" and byte == 0x80:
        return float("nan")
    if kind == "fn" and e == (1 << e_bits) - 1 and f == (1 << m_bits) - 1:
        return float("nan")
    if kind == "ieee" and e == (1 << e_bits) - 1:
        return sign * float("inf") if f == 0 else float("nan")
    if e == 0:
        return sign * (f / 2**m_bits) * 2.0 ** (1 - bias)
    return sign * (1.0 + f / 2**m_bits) * 2.0 ** (e - bias)


def fp8_cast_reference(values, variant: str) -> list[float]:
    """Saturating round-to-nearest-even of each value onto the finite fp8 grid.

    Enumerates all 256 bit patterns, keeps the finite ones, and for each input picks the
    nearest (ties: the pattern with an even mantissa, i.e. lowest bit 0).
    """
    table = [(fp8_decode_reference(b, variant), b) for b in range(256)]
    table = [(v, b) for v, b in table if v == v and abs(v) != float("inf")]
    vmax = max(v for v, _ in table)
    out = []
    for x in values:
        x = min(max(float(x), -vmax), vmax)
        best = None
        for v, b in table:
            d = abs(x - v)
            if best is None or d < best[0] or (d == best[0] and (b & 1) == 0 and best[1] & 1):
                best = (d, b, v)
        out.append(best[2])
    return out


def quantize_fp8_reference(xg: torch.Tensor, variant: str, scale_dtype=torch.float32):
    """Grouped view [G, E] -> (fp8 values as float32 [G, E], stored scales [G])."""
    table = [fp8_decode_reference(b, variant) for b in range(256)]
    vmax = max(v for v in table if v == v and abs(v) != float("inf"))
    sd = {torch.float16: np.float16, torch.float32: np.float32}[scale_dtype]
    tiny = {torch.float16: 6.2e-5, torch.float32: 1e-30}[scale_dtype]
    codes, scales = [], []
    for row in xg.float().numpy():
        amax = np.float32(max(abs(float(v)) for v in row))
        s = np.float32(amax / np.float32(vmax))
        s = np.float32(1.0) if s <= 0 else s
        s = np.float32(sd(max(s, np.float32(tiny))))
        codes.append(fp8_cast_reference([np.float32(v) / s for v in row], variant))
        scales.append(float(s))
    return torch.tensor(codes, dtype=torch.float32), torch.tensor(scales, dtype=torch.float32)


# --- codebooks -------------------------------------------------------------------------
def codebook_assign_reference(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest level by exact rational distances; ties -> the lower index (argmin loop)."""
    from fractions import Fraction

    levels = [Fraction(float(c)) for c in codebook.float().tolist()]
    out = []
    for v in xn.float().reshape(-1).tolist():
        fv = Fraction(v)
        best, best_d = 0, abs(fv - levels[0])
        for i in range(1, len(levels)):
            d = abs(fv - levels[i])
            if d < best_d:
                best, best_d = i, d
        out.append(best)
    return torch.tensor(out, dtype=torch.int64).view(xn.shape)


def gaussian_lloyd_max_reference(bits: int, grid: int = 200001, iters: int = 20000) -> list[float]:
    """Lloyd-Max levels for N(0,1) by brute numerical integration on a fine grid (±8σ).

    Trapezoid running integrals of the density and of t·density, linearly interpolated at
    the cell edges, give each cell's mass and first moment; started from evenly spaced
    levels, the Lloyd step runs to its fixed point.
    """
    t = np.linspace(-8.0, 8.0, grid)
    w = np.exp(-0.5 * t * t)  # unnormalized density; cancels in the centroid ratio
    dt = t[1] - t[0]
    F = np.concatenate([[0.0], np.cumsum((w[1:] + w[:-1]) / 2 * dt)])
    G = np.concatenate([[0.0], np.cumsum((t[1:] * w[1:] + t[:-1] * w[:-1]) / 2 * dt)])
    n = 2**bits
    c = np.linspace(-2.0, 2.0, n)
    for _ in range(iters):
        edges = np.concatenate([[t[0]], (c[1:] + c[:-1]) / 2, [t[-1]]])
        f, g = np.interp(edges, t, F), np.interp(edges, t, G)
        new = (g[1:] - g[:-1]) / (f[1:] - f[:-1])
        if np.abs(new - c).max() < 1e-12:
            c = new
            break
        c = new
    return c.tolist()


def fit_codebook_reference(values: torch.Tensor, init: torch.Tensor, iters: int) -> list[float]:
    """``iters`` plain Lloyd steps in Python floats: nearest level by exact argmin (ties ->
    lower), then each level moves to the mean of its values (empty levels stay), sorted."""
    from fractions import Fraction

    vals = values.float().reshape(-1).tolist()
    c = [float(v) for v in init.float().tolist()]
    for _ in range(iters):
        sums, counts = [0.0] * len(c), [0] * len(c)
        levels = [Fraction(v) for v in c]
        for v in vals:
            fv = Fraction(v)
            best = min(range(len(c)), key=lambda i, fv=fv: (abs(fv - levels[i]), i))
            sums[best] += v
            counts[best] += 1
        c = sorted(float(np.float32(s / n)) if n else c[i] for i, (s, n) in enumerate(zip(sums, counts, strict=True)))
    return c
