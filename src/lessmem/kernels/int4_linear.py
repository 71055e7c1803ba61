"""Group-wise int4 matmul through torch's CPU op ``_weight_int4pack_mm_for_cpu``.

The op computes ``y = x @ W.T`` with ``W[n, k] = s[n, g]·(q[n, k] − 8) + z[n, g]``
(``g = k // group_size``), ``q`` the 4-bit codes in a CPU-specific packed layout made by
``_convert_weight_to_int4pack_for_cpu(q [N, K] int32, inner_k_tiles)``, and
``qScaleAndZeros [K/gs, N, 2]``. With **bf16** activations and scales the op is 6.1x
faster than an fp32 ``nn.Linear`` at 4096×4096, batch 1, 2 threads (3.6x on 1 thread;
``benchmarks/results/bench_linear.json``); with fp32 or fp16 activations it was slower
than fp32 in a one-off check during development (not benchmarked), so activations are
cast to bf16 (the reference twin rounds them the same way). Group sizes 32/64/128/256.

Our codes use the affine form ``W = s·(u − zp)``, so ``z = s·(8 − zp)``.

The packed layout is a fixed permutation of nibbles; ``unpack_int4`` recovers the
plain codes by probing that permutation (needed to save checkpoints portably).

Example:
    >>> import torch
    >>> from lessmem.kernels.int4_linear import pack_int4, unpack_int4
    >>> u = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    >>> torch.equal(unpack_int4(pack_int4(u), 32, 64), u)
    True
"""

from __future__ import annotations

import functools

import torch

GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 2


def supported(n: int, k: int, group_size: int) -> bool:
    """Whether the torch op takes this shape (else use ``lowbit_linear``)."""
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and group_size in GROUP_SIZES
            and k % group_size == 0 and k % 64 == 0 and n % 16 == 0)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Plain codes u [N, K] (uint8 0..15) -> the op's packed uint8 layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(),
                                                             _INNER_K_TILES)


@functools.lru_cache(maxsize=4)
def _nibble_permutation(n: int, k: int) -> torch.Tensor:
    """src[i] = flat index (n·K + k) of the code stored in packed nibble i.

    Probed by packing the base-16 digits of each code's own index: the op moves
    nibbles without changing them, so digit j of the index lands where that code goes.
    """
    idx = torch.arange(n * k, dtype=torch.int64)
    src = torch.zeros(n * k, dtype=torch.int64)
    digits = max(1, (n * k - 1).bit_length() + 3) // 4
    for j in range(digits):
        d = ((idx >> (4 * j)) & 15).to(torch.uint8).view(n, k)
        p = pack_int4(d).view(-1)
        nib = torch.stack([p & 15, p >> 4], dim=1).view(-1).to(torch.int64)
        src |= nib << (4 * j)
    return src.to(torch.int32) if n * k < 2**31 else src


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``pack_int4``: plain codes [N, K] uint8."""
    p = packed.reshape(-1)
    nib = torch.stack([p & 15, p >> 4], dim=1).view(-1)
    out = torch.empty(n * k, dtype=torch.uint8)
    out[_nibble_permutation(n, k).long()] = nib
    return out.view(n, k)


def scales_and_zeros(scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """[N, G] scale and zero point (code units) -> the op's [G, N, 2] bf16 tensor."""
    s = scale.float().to(torch.bfloat16).float()  # z from the stored s, so export/reload is exact
    z = s * (8.0 - zero_point.float())
    return torch.stack([s.T, z.T], dim=-1).contiguous().to(torch.bfloat16)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                qscale_zeros: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W.T`` in the op's bf16 fast path; returns float32 ``[..., N]``."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, qscale_zeros)
    return y.float().view(*x.shape[:-1], qscale_zeros.shape[1])
