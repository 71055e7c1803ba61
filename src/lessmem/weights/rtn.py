"""Round-to-nearest weight quantization into the layout ``QuantLinear`` holds.

A weight ``W [N, K]`` in groups of ``gs`` input columns (``G = K / gs``) becomes
unsigned codes ``u [N, K]`` (uint8, 0..2^b−1), a stored fp16 ``scale [N, G]`` and a
zero point ``zero [N, G]`` in code units (uint8; ``2^(b-1)`` for symmetric), with
``W_hat = scale · (u − zero)``. Scale and zero point come from
``formats.integer.choose_qparams`` (min/max, or max|w| when symmetric), optionally
after shrinking each group's range by a per-group ``clip`` factor (AWQ's clip search).

Example:
    >>> import torch
    >>> from lessmem.weights.rtn import rtn_quantize
    >>> w = torch.randn(8, 64)
    >>> qw = rtn_quantize(w, bits=4, group_size=32, symmetric=False)
    >>> qw.codes.shape, qw.scale.shape
    (torch.Size([8, 64]), torch.Size([8, 2]))
    >>> bool((qw.dequantize() - w).abs().max() <= qw.scale.float().max() / 2 + 1e-6)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.integer import choose_qparams, dequantize_grouped, quantize_grouped


@dataclass
class QuantizedWeight:
    """Codes u [N, K] uint8, scale [N, G] fp16, zero [N, G] uint8 (code units)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    symmetric: bool

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        ug = self.codes.reshape(-1, self.group_size)
        w = dequantize_grouped(ug, self.scale.reshape(-1), self.zero.reshape(-1), self.bits)
        return w.view(n, k)


def group_qparams(wg: torch.Tensor, bits: int, symmetric: bool, clip: torch.Tensor | None = None):
    """Scale [R] fp16 and zero [R] uint8 for grouped rows wg [R, gs] (clip: [R] in (0, 1])."""
    if clip is not None:
        wg = wg * clip.unsqueeze(1)  # scaling the group shrinks max|w|, min and max alike
    scale, zp = choose_qparams(wg, bits, symmetric, 1.0, torch.float16)
    if zp is None:
        zp = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.uint8)
    return scale, zp


def quantize_with(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, gs] for grouped rows given scale/zero (asymmetric form, any zero point)."""
    return quantize_grouped(wg, scale, zero, bits)


def fake_quant(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize then dequantize grouped rows [R, gs] (float32)."""
    return dequantize_grouped(quantize_with(wg, scale, zero, bits), scale, zero, bits)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                 clip: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest codes for W [N, K]; group_size None = one group per row."""
    n, k = w.shape
    gs = k if group_size is None else group_size
    if k % gs:
        raise ValueError(f"group_size={gs} does not divide in_features={k}")
    wg = w.detach().float().reshape(-1, gs)  # [N*G, gs], row-major so groups are contiguous in k
    scale, zero = group_qparams(wg, bits, symmetric, None if clip is None else clip.reshape(-1))
    u = quantize_with(wg, scale, zero, bits)
    g = k // gs
    return QuantizedWeight(u.view(n, k), scale.view(n, g), zero.view(n, g), bits, gs, symmetric)
