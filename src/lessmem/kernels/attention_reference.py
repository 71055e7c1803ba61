"""Slow, obviously-correct twin of the fused quantized attention: dequantize, then softmax.

``dequantize_side`` rebuilds float rows from a :class:`~lessmem.kernels.attention.QuantSide`
with plain bit arithmetic (independently of the cache's own codec), and
``attention_reference`` computes softmax(q·kᵀ + mask)·v over the whole dequantized
history, returning the output and the log-sum-exp of each query row.

Example:
    >>> import torch
    >>> from lessmem.kernels.attention import QuantSide
    >>> side = QuantSide(codes=torch.tensor([[[[0x21]]]], dtype=torch.uint8),
    ...                  scale=torch.ones(1, 1, 1, 1, dtype=torch.float16), zero_point=None,
    ...                  lut=None, bits=4, tg=1, dg=2, zero_const=0.0)
    >>> dequantize_side(side, 2).tolist()   # split layout: low nibble = channel 0
    [[[[1.0, 2.0]]]]
"""

from __future__ import annotations

import torch


def unpack_codes(codes: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    """Integer codes [B, H, T, D] from packed rows (split layout for 2/4/8 bits)."""
    c = codes.long()
    if bits == 8:
        return c
    if bits in (2, 4):
        per, mask = 8 // bits, (1 << bits) - 1
        parts = [(c >> (bits * i)) & mask for i in range(per)]  # slot i: channels i·D/p + j
        return torch.cat(parts, dim=-1)
    out = []
    mask = (1 << bits) - 1
    for d in range(D):  # little-endian bit stream
        bit = d * bits
        byte, sh = bit // 8, bit % 8
        w = c[..., byte]
        if sh + bits > 8:
            w = w | (c[..., byte + 1] << 8)
        out.append((w >> sh) & mask)
    return torch.stack(out, dim=-1)


def dequantize_side(side, D: int) -> torch.Tensor:
    """float32 [B, H, T, D]: x = scale · (lut[c] − z)."""
    c = unpack_codes(side.codes, side.bits, D)
    x = side.lut.float()[c] if side.lut is not None else c.float()
    s = side.scale.float().repeat_interleave(side.tg, dim=2).repeat_interleave(side.dg, dim=3)
    if side.zero_point is not None:
        z = side.zero_point.float().repeat_interleave(side.tg, dim=2).repeat_interleave(side.dg, dim=3)
    else:
        z = side.zero_const
    return s * (x - z)


def attention_reference(q: torch.Tensor, kv, mask: torch.Tensor | None = None):
    """(out [B, Hq, Tq, D], lse [B, Hq, Tq]) of q (already scaled) over a QuantKV."""
    D = q.shape[-1]
    k = dequantize_side(kv.keys, D)
    v = dequantize_side(kv.values, D)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.float() @ k.transpose(-1, -2)  # [B, Hq, Tq, T]
    if mask is not None:
        s = s + mask.float().unsqueeze(1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v, lse
