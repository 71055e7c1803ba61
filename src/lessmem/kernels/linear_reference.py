"""Slow, obviously-correct twins of the fused linear kernels (dequantize, then matmul).

Every function materialises the float weight and multiplies in float64, so it is the
yardstick the fast paths (C++ kernels, torch's int4pack op) are tested against.

Example:
    >>> import torch
    >>> from lessmem.kernels.linear_reference import dequant_grouped_weight, quantize_act16
    >>> u = torch.tensor([[0, 15, 8, 8]], dtype=torch.uint8)
    >>> dequant_grouped_weight(u, torch.tensor([[0.5]]), torch.tensor([[8.0]]), 4).tolist()
    [[-4.0, 3.5, 0.0, 0.0]]
    >>> q, d = quantize_act16(torch.tensor([[1.0, -0.5, 0.25, 0.0]]), 4)
    >>> q.tolist()
    [[32258, -16129, 8064, 0]]
"""

from __future__ import annotations

import torch

from ..formats.packing import unpack_bits

ACT16_MAX = 32258  # max |q|: q = 256·hi + lo with hi in [-126, 126], lo in [-128, 127] (linear_cpp)


def dequant_grouped_weight(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """float64 W [N, K] = scale[n, k // gs] · (u[n, k] − zero[n, k // gs])."""
    s = scale.double().repeat_interleave(group_size, dim=1)
    z = zero.double().repeat_interleave(group_size, dim=1)
    return s * (u.double() - z)


def quantize_act16(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) 16-bit fixed point, as ``lowbit_linear`` rounds its activations.

    x [M, K] float32 -> q [M, K] int32 in [−32258, 32258] and d [M, G] float32 with
    d = max|x_g| / 32258, q = round_half_even(x · (1/d)) (the same float32 operations as the
    kernel, so the codes agree exactly); x ≈ d · q with |x − d·q| ≤ d/2.
    """
    m, k = x.shape
    xg = x.float().reshape(m, k // group_size, group_size)
    d = xg.abs().amax(dim=-1) / ACT16_MAX
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), torch.zeros_like(d))
    q = torch.round(xg * inv[..., None]).clamp(-ACT16_MAX, ACT16_MAX).to(torch.int32)
    return q.reshape(m, k), d


def lowbit_linear_ref(x, codes, bits, scale, zero, group_size):
    """x̂ @ W.T in float64, x̂ = d·q from ``quantize_act16``, W from the unpacked codes."""
    n, k = scale.shape[0], x.shape[-1]
    u = unpack_bits(codes, bits, n * k).view(n, k)
    w = dequant_grouped_weight(u, scale, zero, group_size)
    q, d = quantize_act16(x, group_size)
    xhat = q.double() * d.double().repeat_interleave(group_size, dim=1)
    return (xhat @ w.T).float()


def int8_linear_ref(x, w, scale):
    return (x.double() @ (w.double() * scale.double().reshape(-1)[:, None]).T).float()


def w8a8_linear_ref(xq, sx, w, scale):
    acc = xq.double() @ w.double().T  # exact integer sums
    return (acc * sx.double()[:, None] * scale.double().reshape(-1)[None, :]).float()


def int4pack_linear_ref(x, u, scale_bf16, zeros_bf16, group_size):
    """What ``_weight_int4pack_mm_for_cpu`` computes: x rounded to bf16, then
    x @ W.T with W[n, k] = s[n, g] · (u[n, k] − 8) + z[n, g] (s, z as stored in bf16)."""
    s = scale_bf16.double().repeat_interleave(group_size, dim=1)
    z = zeros_bf16.double().repeat_interleave(group_size, dim=1)
    w = s * (u.double() - 8) + z
    return (x.to(torch.bfloat16).double() @ w.T).float()
