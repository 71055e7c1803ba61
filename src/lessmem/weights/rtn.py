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

import numbers
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


def fake_quant(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize then dequantize grouped rows [R, gs] (float32)."""
    return dequantize_grouped(quantize_grouped(wg, scale, zero, bits), scale, zero, bits)


def check_size(name: str, v) -> int:
    """``v`` as a layer size: a positive integer (an int or numpy integer; not a bool or str)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return int(v)


def check_group_size(group_size, in_features: int) -> int:
    """The group size to use for ``in_features`` columns (None: one group per row), checked."""
    if group_size is None:
        return in_features
    check_size("group_size", group_size)
    if in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features}")
    return group_size


def check_weight(w, bits: int) -> tuple[int, int]:
    """``(N, K)`` of a 2-D floating weight, with ``bits`` one the layouts hold (2, 3, 4, 8)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"the weight must be a 2-D floating tensor [out, in], got {got}")
    if isinstance(bits, bool) or bits not in (2, 3, 4, 8):
        raise ValueError(f"bits={bits!r}; allowed: 2, 3, 4, 8")
    return w.shape


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                 clip: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest codes for W [N, K]; group_size None = one group per row."""
    n, k = check_weight(w, bits)
    gs = check_group_size(group_size, k)
    wg = w.detach().float().reshape(-1, gs)  # [N*G, gs], row-major so groups are contiguous in k
    scale, zero = group_qparams(wg, bits, symmetric, None if clip is None else clip.reshape(-1))
    u = quantize_grouped(wg, scale, zero, bits)
    g = k // gs
    return QuantizedWeight(u.view(n, k), scale.view(n, g), zero.view(n, g), bits, gs, symmetric)
