"""Slow, obviously-correct twins of the fused linear kernels (dequantize, then matmul).

Every function materialises the float weight and multiplies in float64, so it is the
yardstick the fast paths (C++ kernels, torch's int4pack op) are tested against.

Example:
    >>> import torch
    >>> from lessmem.kernels.linear_reference import dequant_grouped_weight
    >>> u = torch.tensor([[0, 15, 8, 8]], dtype=torch.uint8)
    >>> dequant_grouped_weight(u, torch.tensor([[0.5]]), torch.tensor([[8.0]]), 4).tolist()
    [[-4.0, 3.5, 0.0, 0.0]]
"""

from __future__ import annotations

import torch

from ..formats.packing import unpack_bits


def dequant_grouped_weight(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """float64 W [N, K] = scale[n, k // gs] · (u[n, k] − zero[n, k // gs])."""
    s = scale.double().repeat_interleave(group_size, dim=1)
    z = zero.double().repeat_interleave(group_size, dim=1)
    return s * (u.double() - z)


def lowbit_linear_ref(x, codes, bits, scale, zero, group_size):
    n, k = scale.shape[0], x.shape[-1]
    u = unpack_bits(codes, bits, n * k).view(n, k)
    w = dequant_grouped_weight(u, scale, zero, group_size)
    return (x.double() @ w.T).float()


def int8_linear_ref(x, w, scale):
    return (x.double() @ (w.double() * scale.double()[:, None]).T).float()


def w8a8_linear_ref(xq, sx, w, scale):
    acc = xq.double() @ w.double().T  # exact integer sums
    return (acc * sx.double()[:, None] * scale.double()[None, :]).float()


def int4pack_linear_ref(x, u, scale_bf16, zeros_bf16, group_size):
    """What ``_weight_int4pack_mm_for_cpu`` computes: x rounded to bf16, then
    x @ W.T with W[n, k] = s[n, g] · (u[n, k] − 8) + z[n, g] (s, z as stored in bf16)."""
    s = scale_bf16.double().repeat_interleave(group_size, dim=1)
    z = zeros_bf16.double().repeat_interleave(group_size, dim=1)
    w = s * (u.double() - 8) + z
    return (x.to(torch.bfloat16).double() @ w.T).float()
