"""Keys rounded for the scores they feed, not for themselves (``KVConfig.key_rounding``).

A key's error reaches attention only as ``q·δ``: what matters is ``E[(q·δ)²] = δᵀ Σ δ``
with ``Σ = E[q qᵀ]`` the second moment of the queries that will read it, not ``|δ|²``.
Queries are far from isotropic (a few directions carry most of their energy), so rounding
each value to its nearest level wastes precision. With per-channel scales and zero points
fixed (chosen from the block's range as before), the codes of one token are chosen one
channel at a time and each rounding error is fed into the channels not yet rounded, in
proportion to the inverse of ``Σ``: the optimal-brain-quantization update, in GPTQ's
Cholesky form (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023), with the tokens of a block as the rows and the key
channels as the columns. Nothing stored changes: the same codes, scales and zero points,
read by the same kernels.

``Σ`` is not calibrated ahead: each layer accumulates its own queries as attention reads
the cache (:class:`QueryMoments`, the first ``MAX_ROWS`` query rows per KV head, which a
prefill supplies at once), in the basis the keys are stored in. A block quantized before
any query was seen (the first blocks of the first prefill chunk) is rounded to nearest.

On the built-in model, through the evaluation protocol (16 windows of WikiText-2 test,
``benchmarks/results/bench_kv_quality_key_rounding.json``), the next-token KLD falls by
21–35% on ``best-4``, ``best-2`` and the per-layer allocations of ``kv_configs/mixed-*``;
``best-2`` goes from +2.18% to +1.75% perplexity.

Example:
    >>> import torch
    >>> from lessmem.formats import PerGroup
    >>> from lessmem.kvcache.config import KVTensorConfig
    >>> from lessmem.kvcache.codec import encode
    >>> g = torch.Generator().manual_seed(0)
    >>> mix = torch.randn(2, 8, generator=g)  # queries mostly in a 2-dimensional subspace
    >>> q = torch.randn(4096, 2, generator=g) @ mix + 0.1 * torch.randn(4096, 8, generator=g)
    >>> k = torch.randn(1, 1, 64, 8, generator=g)
    >>> spec = KVTensorConfig("uint", 3, PerGroup(64, axis=-2))
    >>> m = QueryMoments(1, 8); m.add(q.view(1, 1, -1, 8))
    >>> near, tuned = encode(k, spec), round_keys(k, encode(k, spec), spec, m.factor(None))
    >>> from lessmem.kernels.attention import QuantSide
    >>> deq = lambda e: QuantSide(e.codes, e.scale, e.zero_point, kv_layout(spec, 8)).dequantize()
    >>> err = lambda e: ((deq(e) - k)[0, 0] @ q.T).pow(2).mean().item()
    >>> err(tuned) < 0.6 * err(near)  # the score error's second moment
    True
"""

from __future__ import annotations

import torch

from ..formats.integer import dequantize_grouped, quantize_grouped
from ..kernels._build import load_cpp_file
from .codec import Encoded, kv_layout
from .config import KVTensorConfig

MAX_ROWS = 2048  # query rows per KV head accumulated, then the moments are kept as they are
MIN_ROWS = 64    # fewer rows seen: no factor yet (nearest rounding)
DAMP = 0.01      # ridge added to Σ, as a fraction of its mean diagonal (GPTQ's percdamp)


class QueryMoments:
    """``Σ_h = Σ q qᵀ`` over the query rows of each KV head's group seen so far."""

    def __init__(self, kv_heads: int, head_dim: int):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.sum: torch.Tensor | None = None
        self.rows = 0
        self._factor = None  # (rows, rotation id, U): the last factor made

    @property
    def full(self) -> bool:
        return self.rows >= MAX_ROWS

    def add(self, q: torch.Tensor) -> None:
        """Queries ``[B, Hq, T, D]`` as the model made them (unrotated, unscaled)."""
        if self.full:
            return
        B, Hq, T, D = q.shape
        x = q.detach().float().reshape(B, self.kv_heads, Hq // self.kv_heads * T, D).transpose(0, 1)
        x = x.reshape(self.kv_heads, -1, D)
        s = x.transpose(1, 2) @ x
        self.sum = s if self.sum is None else self.sum + s
        self.rows += x.shape[1]

    def factor(self, rot_t: torch.Tensor | None) -> torch.Tensor | None:
        """Upper Cholesky factor ``U`` of ``(R Σ Rᵀ + λI)⁻¹`` per KV head ``[H, D, D]``, in the
        basis the keys are stored in (``rot_t`` = Rᵀ, [D, D] or one per KV head; None:
        unrotated), or None before ``MIN_ROWS`` rows."""
        if self.rows < MIN_ROWS:
            return None
        key = (self.rows, None if rot_t is None else id(rot_t))
        if self._factor is not None and self._factor[0] == key:
            return self._factor[1]
        S = self.sum.double() / self.rows
        if rot_t is not None:
            r = rot_t.to(S)
            S = r.transpose(-1, -2) @ S @ r
        eye = torch.eye(self.head_dim, dtype=S.dtype, device=S.device)
        S = S + DAMP * S.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye + 1e-12 * eye
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(S)), upper=True).float()
        self._factor = (key, U)
        return U


def applies(spec: KVTensorConfig) -> bool:
    """Whether ``spec`` is a side this rounding changes: integer codes with a zero point in
    per-channel token groups (keys as KIVI stores them) at one bits for all channels. With
    bits per channel the errors of the wide channels would be pushed into the narrow ones
    rounded after them (a probe on the ≤ 2.5-bit config was worse), so those keep nearest
    rounding."""
    return spec.quantized and spec.format == "uint" and spec.per_channel and not spec.channel_bits


def _cpp():
    """The C++ twin (``kernels/csrc/key_rounding.cpp``), or None without a compiler."""
    return load_cpp_file("lessmem_keyround", "key_rounding.cpp", ["round_keys_rows"])


def round_keys(x: torch.Tensor, enc: Encoded, spec: KVTensorConfig, U: torch.Tensor,
               use_cpp: bool = True) -> Encoded:
    """``enc`` (``codec.encode(x, spec)``) with its codes chosen again: channel by channel,
    each rounding error fed forward through ``U`` (``QueryMoments.factor``, one per head of
    ``x [B, H, T, D]``, in x's basis). Scales and zero points are kept. On the CPU one C++
    call does it (every token row in parallel); elsewhere, or without a compiler, a loop over
    the channels through the shared affine quantizer (``formats.integer``), its tested twin."""
    B, H, T, D = x.shape
    lay = kv_layout(spec, D)
    tg = lay.token_group
    coef = (U / U.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)).float()  # [H, D, D]: U_jk / U_jj
    mod = _cpp() if use_cpp and x.device.type == "cpu" else None
    if mod is not None:
        codes = mod.round_keys_rows(x.float().contiguous(), enc.scale.float().contiguous(),
                                    enc.zero_point.float().contiguous(), coef.contiguous(),
                                    float(2 ** spec.bits - 1))
        return Encoded(lay.pack(codes), enc.scale, enc.zero_point)
    # channel-major [D, B, H, T]: channel j of every token is one contiguous row, grouped in
    # tg-token groups as the affine quantizer takes them (scales [D, B·H·T/tg])
    w = x.float().permute(3, 0, 1, 2).contiguous()
    scale = enc.scale.float().permute(3, 0, 1, 2).reshape(D, -1)  # as floats once, not per call
    zp = enc.zero_point.float().permute(3, 0, 1, 2).reshape(D, -1)
    coef = coef.permute(1, 2, 0).reshape(D, D, 1, H, 1)  # broadcast over [B, H, T]
    codes = torch.empty(D, B, H, T, dtype=torch.uint8, device=x.device)
    for j in range(D):
        xg = w[j].view(-1, tg)
        u = quantize_grouped(xg, scale[j], zp[j], spec.bits)
        codes[j] = u.view(B, H, T)
        if j + 1 < D:  # the rounding error fed into the channels after j
            err = (xg - dequantize_grouped(u, scale[j], zp[j], spec.bits)).view(1, B, H, T)
            w[j + 1:] -= err * coef[j, j + 1:]
    return Encoded(lay.pack(codes.permute(1, 2, 3, 0)), enc.scale, enc.zero_point)
