"""The torch fallbacks of the fused linear kernels (production path without the C++ kernels).

``linear_cpp`` calls these when no compiler is available or when a tensor is not on the
CPU (the C++ kernels read CPU memory only). Each computes what its C++ kernel computes,
with vectorized torch ops on the tensors' own device, float32 arithmetic and no float64:

- ``int8_linear_torch``   y = (x · wᵀ) · s                   float32 sums, as the kernel
- ``w8a8_linear_torch``   y = (float) Σ xq·w · sx · s         exact integer sums, as the
  kernel's int32 ones: float32 matmuls over slices of at most 1024 columns are exact
  (|Σ| ≤ 1024 · 128² = 2²⁴), and the slices are added as int64
- ``lowbit_linear_torch`` y = x̂ · Wᵀ (+ bias), with x̂ the activations rounded per (row,
  group) to 16-bit fixed point exactly as the kernel rounds them (``quantize_act16``) and
  W = s · (u − z) (exact in float32: an fp16 scale times a 4-bit integer); the kernel sums
  each group in int32 and the groups in float32, this sums everything in float32, so the
  two agree to float32 rounding

The float weight is never built whole: at most ``CHUNK_WEIGHTS`` weights (16 MiB in
float32) are expanded at a time, one slice of output rows after another.

The test oracle these are checked against is ``linear_reference`` (float64, dequantize then
matmul); production code never imports it.

Example:
    >>> import torch
    >>> from lessmem.kernels.linear_torch import int8_linear_torch
    >>> w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    >>> s = (torch.rand(16) / 100).half()
    >>> x = torch.randn(1, 64)
    >>> ref = x @ (w.float() * s.float()[:, None]).T
    >>> bool(torch.allclose(int8_linear_torch(x, w, s), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from ..formats.packing import unpack_bits

ACT16_MAX = 32258  # max |q|: what the C++ kernel's split q = 256·hi + lo can hold
CHUNK_WEIGHTS = 1 << 22  # weights expanded to float at a time (16 MiB in float32)
EXACT_COLUMNS = 1024  # float32 sums of this many int8·int8 products are exact integers


def row_slices(n: int, k: int):
    """``(start, stop)`` slices of ``n`` output rows, at most ``CHUNK_WEIGHTS`` weights each."""
    step = max(1, CHUNK_WEIGHTS // max(k, 1))
    return [(r, min(n, r + step)) for r in range(0, n, step)]


def int8_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x [M, K] @ (scale[:, None] · w).T`` for int8 ``w [N, K]``, fp16 ``scale [N]``."""
    x = x.float()
    s = scale.reshape(-1).float().to(x.device)
    y = x.new_empty(x.shape[0], w.shape[0])
    for r0, r1 in row_slices(w.shape[0], w.shape[1]):
        y[:, r0:r1] = (x @ w[r0:r1].to(x.device).float().T) * s[r0:r1]
    return y


def w8a8_linear_torch(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """float32 ``(float) Σ_k xq[m, k] · w[n, k] · sx[m] · scale[n]`` (int8 xq, w; exact sums)."""
    n, k = w.shape
    dev = xq.device
    sums = torch.zeros(xq.shape[0], n, dtype=torch.int64, device=dev)
    for c0 in range(0, k, EXACT_COLUMNS):
        xs = xq[:, c0:c0 + EXACT_COLUMNS].float()
        for r0, r1 in row_slices(n, min(k, EXACT_COLUMNS)):
            part = xs @ w[r0:r1, c0:c0 + EXACT_COLUMNS].to(dev).float().T
            sums[:, r0:r1] += part.to(torch.int64)
    s = scale.reshape(-1).float().to(dev)
    return sums.float() * sx.float().to(dev)[:, None] * s[None, :]


def quantize_act16(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round x [M, K] per (row, group) as ``lowbit_linear`` does: (q [M, K] float32 integers
    in [−32258, 32258], d [M, G] float32) with d = max|x_g| / 32258 and q = round(x · (1/d))
    (half to even; q = 0 where the group is all zeros)."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group_size, group_size)
    d = xg.abs().amax(dim=-1) / ACT16_MAX
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xg * inv[..., None]).clamp_(-ACT16_MAX, ACT16_MAX)
    return q.reshape(m, k), d


def lowbit_linear_torch(x: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor,
                        zero: torch.Tensor, group_size: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x̂ [M, K] @ Wᵀ (+ bias)``, W = scale · (u − zero) per group of ``group_size``,
    u the ``bits``-bit codes packed row-major by ``pack_bits``; shapes as ``lowbit_linear``."""
    n, k = scale.shape[0], x.shape[-1]
    groups = k // group_size
    q, d = quantize_act16(x, group_size)
    xhat = (q.view(-1, groups, group_size) * d[..., None]).view(-1, k)
    dev = xhat.device
    row_bytes = k * bits // 8  # whole bytes: k is a multiple of 32
    flat = codes.reshape(-1)
    y = xhat.new_empty(xhat.shape[0], n)
    for r0, r1 in row_slices(n, k):
        u = unpack_bits(flat[r0 * row_bytes:r1 * row_bytes], bits, (r1 - r0) * k).to(dev)
        u = u.view(r1 - r0, groups, group_size).float()
        z = zero[r0:r1].to(dev).float()[..., None]
        s = scale[r0:r1].to(dev).float()[..., None]
        y[:, r0:r1] = xhat @ ((u - z) * s).view(r1 - r0, k).T
    if bias is not None:
        y += bias.to(dev).float()
    return y
