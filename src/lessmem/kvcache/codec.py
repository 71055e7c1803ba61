"""Encode/decode one chunk of keys or values ``[B, H, T, D]`` in the cache's block layout.

Layout (what the fused attention kernel reads, see ``lessmem.kernels.attention``):

- ``codes``  uint8 ``[B, H, T, D·bits/8]``, one packed row per token. For 2/4/8 bits
  the row is *split-packed*: byte ``j`` holds the codes of channels ``j, j + D/p,
  j + 2D/p, …`` (p = 8/bits codes per byte, lowest bits first), so unpacking is a
  contiguous, vectorizable loop. 3-bit rows are a little-endian bit stream
  (``formats.packing.pack_bits``).
- ``scale``  fp16 ``[B, H, T/tg, D/dg]`` and ``zero_point`` uint8 of the same shape
  (asymmetric formats only), where (tg, dg) is the (tokens, channels) group shape.
- a lookup table ``lut`` float32 ``[2^bits]`` maps a code to its level, so every format
  dequantizes as ``x = scale · (lut[c] − z)`` (z = zero point, or 0):
  int (symmetric): lut[c] = c − 2^(b−1); uint: lut[c] = c; fp8: the fp8 value of the
  byte; lm: Lloyd-Max levels of a unit Gaussian (scale = RMS of the group).

Example:
    >>> import torch
    >>> from lessmem.formats import PerGroup
    >>> from lessmem.kvcache.config import KVTensorConfig
    >>> spec = KVTensorConfig("uint", 4, PerGroup(8, axis=-2))
    >>> x = torch.randn(1, 2, 16, 64)
    >>> enc = encode(x, spec)
    >>> tuple(enc.codes.shape), tuple(enc.scale.shape)
    ((1, 2, 16, 32), (1, 2, 2, 64))
    >>> bool((decode(enc, spec, 64) - x).abs().max() < 0.5)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..formats.integer import choose_qparams, quantize_grouped
from ..formats.packing import pack_bits, unpack_bits
from .config import KVTensorConfig

_FP8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Encoded:
    """Codes, scale and (optional) zero point of a chunk, in the block layout."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None


@lru_cache(maxsize=None)
def lloyd_max_levels(bits: int) -> tuple[float, ...]:
    """Lloyd-Max reconstruction levels for a unit Gaussian (MSE-optimal scalar quantizer).

    Alternates centroid (conditional mean of each cell) and midpoint (cell edges) steps
    on a fine grid until the levels settle.
    """
    n = 2**bits
    grid = torch.linspace(-6, 6, 24001, dtype=torch.float64)
    pdf = torch.exp(-0.5 * grid**2)
    lv = torch.linspace(-2.0, 2.0, n, dtype=torch.float64) * (1 + bits / 4)
    for _ in range(300):
        edges = (lv[1:] + lv[:-1]) / 2
        idx = torch.bucketize(grid, edges)
        num = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, grid * pdf)
        den = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, pdf)
        lv = num / den
    return tuple(float(v) for v in lv)


@lru_cache(maxsize=None)
def _lut_cpu(fmt: str, bits: int) -> torch.Tensor:
    if fmt == "int":
        return torch.arange(2**bits, dtype=torch.float32) - 2 ** (bits - 1)
    if fmt == "uint":
        return torch.arange(2**bits, dtype=torch.float32)
    if fmt in _FP8:
        v = torch.arange(256, dtype=torch.uint8).view(_FP8[fmt]).float()
        return torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    if fmt == "lm":
        return torch.tensor(lloyd_max_levels(bits), dtype=torch.float32)
    raise ValueError(f"format {fmt!r} has no lookup table")


def lut(spec: KVTensorConfig, device=None) -> torch.Tensor:
    t = _lut_cpu(spec.format, spec.bits)
    return t if device is None or t.device == torch.device(device) else t.to(device)


def check_head_dim(spec: KVTensorConfig, head_dim: int) -> None:
    if not spec.quantized:
        return
    _, dg = spec.group_shape(head_dim)
    if head_dim % dg or (head_dim * spec.bits) % 8 or head_dim % (8 // math.gcd(8, spec.bits)):
        raise ValueError(
            f"head_dim={head_dim} does not fit {spec.format}{spec.bits} with channel group {dg}; "
            "allowed: head_dim a multiple of 8 and of the channel group size"
        )


def _pack_rows(u: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [B, H, T, D] -> packed rows [B, H, T, D·bits/8] (split layout)."""
    B, H, T, D = u.shape
    if bits == 8:
        return u.contiguous()
    if bits in (2, 4):  # byte j = Σ_i code[i·D/p + j] << (bits·i)
        per, n = 8 // bits, D // (8 // bits)
        out = u[..., :n].clone()
        for i in range(1, per):
            out |= u[..., i * n:(i + 1) * n] << (bits * i)
        return out
    return pack_bits(u.reshape(-1), bits).view(B, H, T, D * bits // 8)


def _unpack_rows(c: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    B, H, T, _ = c.shape
    if bits == 8:
        return c
    n = B * H * T * D
    if bits in (2, 4):
        per = 8 // bits
        inter = unpack_bits(c.reshape(-1), bits, n).view(B, H, T, D // per, per)
        return inter.transpose(-1, -2).reshape(B, H, T, D)
    return unpack_bits(c.reshape(-1), bits, n).view(B, H, T, D)


def encode(x: torch.Tensor, spec: KVTensorConfig) -> Encoded:
    """Quantize a chunk ``x [B, H, T, D]`` (T a multiple of the token group)."""
    B, H, T, D = x.shape
    tg, dg = spec.group_shape(D)
    xf = x.float()
    if spec.per_channel:  # groups: (B, H, T/tg, D) of tg tokens each
        xg = xf.view(B, H, T // tg, tg, D).transpose(3, 4).reshape(-1, tg)
    else:  # groups: (B, H, T, D/dg) of dg channels each
        xg = xf.reshape(-1, dg)
    bits, fmt = spec.bits, spec.format
    zp = None
    if fmt in ("int", "uint"):
        scale, zp = choose_qparams(xg, bits, fmt == "int", spec.clip_ratio, torch.float16)
        u = quantize_grouped(xg, scale, zp, bits)
    elif fmt in _FP8:
        fmax = torch.finfo(_FP8[fmt]).max
        amax = xg.abs().amax(dim=1) * spec.clip_ratio
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).to(torch.float16)
        y = (xg / scale.float().unsqueeze(1)).clamp(-fmax, fmax)
        u = y.to(_FP8[fmt]).view(torch.uint8)
    else:  # "lm": nearest Lloyd-Max level of x / rms
        rms = xg.pow(2).mean(dim=1).sqrt() * spec.clip_ratio
        scale = torch.where(rms > 0, rms, torch.ones_like(rms)).to(torch.float16)
        levels = lut(spec, x.device)
        edges = (levels[1:] + levels[:-1]) / 2
        u = torch.bucketize(xg / scale.float().unsqueeze(1), edges).to(torch.uint8)
    if spec.per_channel:
        u = u.view(B, H, T // tg, D, tg).transpose(3, 4).reshape(B, H, T, D)
        qshape = (B, H, T // tg, D)
    else:
        u = u.view(B, H, T, D)
        qshape = (B, H, T, D // dg)
    codes = _pack_rows(u, bits)
    return Encoded(codes, scale.view(qshape), zp.view(qshape) if zp is not None else None)


def decode(enc: Encoded, spec: KVTensorConfig, head_dim: int) -> torch.Tensor:
    """float32 ``[B, H, T, D]`` from an encoded chunk (the slow, obvious path)."""
    D = head_dim
    tg, dg = spec.group_shape(D)
    c = _unpack_rows(enc.codes, spec.bits, D).long()
    x = lut(spec, c.device)[c]
    s = enc.scale.float()
    z = enc.zero_point.float() if enc.zero_point is not None else None
    if tg > 1:
        s = s.repeat_interleave(tg, dim=2)
        z = z.repeat_interleave(tg, dim=2) if z is not None else None
    if dg > 1:
        s = s.repeat_interleave(dg, dim=3)
        z = z.repeat_interleave(dg, dim=3) if z is not None else None
    if z is not None:
        x = x - z
    return x * s
