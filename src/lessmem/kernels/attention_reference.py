"""Slow, obviously-correct twin of the fused quantized attention: dequantize, then softmax.

This module is used by the tests only. ``dequantize_side`` rebuilds float rows from a
:class:`~lessmem.kernels.attention.QuantSide`: it reads the side's
:class:`~lessmem.formats.kvlayout.KVLayout` (packing, bits, groups, zero point, levels)
but unpacks with its own plain bit arithmetic, independently of ``KVLayout.unpack`` (which
the torch fallback and the cache's dequantized path use). ``attention_reference`` computes
softmax(q·kᵀ + mask)·v over the whole dequantized history, returning the output and the
log-sum-exp of each query row.

Example:
    >>> import torch
    >>> from lessmem.formats.kvlayout import KVLayout
    >>> from lessmem.kernels.attention import QuantSide
    >>> side = QuantSide(codes=torch.tensor([[[[0x21]]]], dtype=torch.uint8),
    ...                  scale=torch.ones(1, 1, 1, 1, dtype=torch.float16), zero_point=None,
    ...                  layout=KVLayout(bits=4, head_dim=2, channel_group=2))
    >>> dequantize_side(side).tolist()   # split layout: low nibble = channel 0
    [[[[1.0, 2.0]]]]
"""

from __future__ import annotations

import torch


def unpack_codes(codes: torch.Tensor, layout) -> torch.Tensor:
    """Integer codes [B, H, T, D] from packed rows, as ``layout.packing`` describes them."""
    if layout.packing == "mixed":  # runs of equal bits, each a bit stream; 0 bits: codes 0
        out, byte = [], 0
        for bits, n in layout.runs:
            if bits == 0:
                out.append(torch.zeros(*codes.shape[:-1], n, dtype=torch.long, device=codes.device))
                continue
            nb = n * bits // 8
            out.append(_unpack(codes[..., byte:byte + nb].long(), bits, n, "stream"))
            byte += nb
        return torch.cat(out, dim=-1)
    return _unpack(codes.long(), layout.bits, layout.head_dim, layout.packing)


def _unpack(c: torch.Tensor, bits: int, D: int, packing: str) -> torch.Tensor:
    if bits == 8:
        return c
    if packing == "split":
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


def dequantize_side(side, D: int | None = None) -> torch.Tensor:
    """float32 [B, H, T, D]: x = scale · (lut[c] − z) (``D``, if given, must be the layout's)."""
    lay = side.layout
    if D is not None and D != lay.head_dim:
        raise ValueError(f"D={D}; allowed: the layout's head_dim={lay.head_dim}")
    c = unpack_codes(side.codes, lay)
    x = torch.tensor(lay.levels, dtype=torch.float32, device=c.device)[c] if lay.levels is not None else c.float()
    tg, dg = lay.token_group, lay.channel_group
    s = side.scale.float().repeat_interleave(tg, dim=2).repeat_interleave(dg, dim=3)
    if side.zero_point is not None:
        z = side.zero_point.float().repeat_interleave(tg, dim=2).repeat_interleave(dg, dim=3)
    else:
        z = lay.zero_const
    return s * (x - z)


def attention_reference(q: torch.Tensor, kv, mask: torch.Tensor | None = None):
    """(out [B, Hq, Tq, D], lse [B, Hq, Tq]) of q (already scaled) over a QuantKV."""
    k = dequantize_side(kv.keys)
    v = dequantize_side(kv.values)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.float() @ k.transpose(-1, -2)  # [B, Hq, Tq, T]
    if mask is not None:
        s = s + mask.float().unsqueeze(1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v, lse
