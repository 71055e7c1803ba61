"""Slow, obviously-correct twin of the fused GGUF dequant-matmul (``gguf_linear_cpp``).

The weight ``W [N, K]`` is held as the raw GGUF blocks of its rows (uint8
``[N, K / block_size * type_size]``, exactly what a ``.gguf`` file stores). The twin
decodes them with ``formats.gguf.dequantize_gguf`` (the numpy decoders that match
llama.cpp / the ``gguf`` package bit for bit) and multiplies in float64:

    y [M, N] = x [M, K] · W_hat [N, K]ᵀ

Example:
    >>> import torch
    >>> from lessmem.formats.gguf import quantize_gguf
    >>> from lessmem.kernels.gguf_linear_reference import gguf_linear_ref
    >>> g = torch.Generator().manual_seed(0)
    >>> w = torch.randn(3, 64, generator=g)
    >>> raw = torch.from_numpy(quantize_gguf(w, "q8_0"))
    >>> x = torch.randn(2, 64, generator=g)
    >>> y = gguf_linear_ref(x, raw, "q8_0", 3)
    >>> y.shape, bool((y - x @ w.T).abs().max() < 0.2)
    (torch.Size([2, 3]), True)
"""

from __future__ import annotations

import torch

from ..formats.gguf import dequantize_gguf, gguf_type


def gguf_weight_ref(raw: torch.Tensor, qtype, out_features: int) -> torch.Tensor:
    """float32 ``W_hat [N, K]`` decoded from raw GGUF rows ``[N, row_bytes]``."""
    t = gguf_type(qtype)
    n = int(out_features)
    row_bytes = raw.numel() // max(n, 1)
    k = row_bytes // t.type_size * t.block_size
    return dequantize_gguf(raw, t, (n, k))


def gguf_linear_ref(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int) -> torch.Tensor:
    """``x [..., K] @ W_hat.T`` in float64, returned as float32 ``[..., N]``."""
    w = gguf_weight_ref(raw, qtype, out_features)
    y = x.reshape(-1, x.shape[-1]).double() @ w.double().T
    return y.float().view(*x.shape[:-1], int(out_features))
