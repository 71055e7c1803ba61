"""The torch fallback of the quantized attention (production path without the C++ kernel).

``torch_attention(q, kv, mask)`` walks the history in chunks of 256 tokens: each chunk is
dequantized with its layout (``QuantSide.dequantize``, i.e. ``KVLayout.dequantize``) and
folded into a flash-style online softmax (running max m, running sum l, accumulator
rescaled by exp(m_old − m_new)), so only one chunk is ever held in float. It returns the
same ``(out, lse)`` as :func:`~lessmem.kernels.attention.quantized_attention`, which calls
it when the C++ kernel is not available. The test oracle that both are checked against is
``attention_reference`` (dequantize the whole history with independent bit arithmetic).

Example:
    >>> import torch
    >>> from lessmem.formats.kvlayout import KVLayout
    >>> from lessmem.kernels.attention import QuantKV, QuantSide
    >>> from lessmem.kernels.attention_reference import attention_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> lay = KVLayout(bits=4, head_dim=64, channel_group=64, zero_const=8.0)
    >>> side = lambda: QuantSide(torch.randint(0, 256, (1, 2, 300, 32), dtype=torch.uint8, generator=g),
    ...                          torch.rand(1, 2, 300, 1, generator=g).half(), None, lay)
    >>> kv = QuantKV(side(), side())
    >>> q = torch.randn(1, 4, 2, 64, generator=g) * 0.1
    >>> o, lse = torch_attention(q, kv)
    >>> bool(torch.allclose(o, attention_reference(q, kv)[0], atol=1e-4))
    True
"""

from __future__ import annotations

import torch

CHUNK = 256  # history tokens dequantized at a time


def torch_attention(q: torch.Tensor, kv, mask: torch.Tensor | None = None):
    """(out float32 [B, Hq, Tq, D], lse [B, Hq, Tq]) of ``q`` over a QuantKV/SegmentedKV
    history; ``mask`` additive float [B, Tq, T] or None (shapes checked by the caller)."""
    B, Hq, Tq, D = q.shape
    T = kv.n_tokens
    rep = Hq // kv.n_kv_heads
    tg = max(kv.keys.tg, kv.values.tg)
    step = max(CHUNK - CHUNK % tg, tg)
    m = torch.full((B, Hq, Tq), float("-inf"), device=q.device)
    l = torch.zeros(B, Hq, Tq, device=q.device)
    acc = torch.zeros(B, Hq, Tq, D, device=q.device)
    qf = q.float()
    for t0 in range(0, T, step):  # online softmax over chunks of the history
        t1 = min(T, t0 + step)
        k = kv.keys.slice_tokens(t0, t1).dequantize().repeat_interleave(rep, dim=1)
        v = kv.values.slice_tokens(t0, t1).dequantize().repeat_interleave(rep, dim=1)
        s = qf @ k.transpose(-1, -2)
        if mask is not None:
            s = s + mask[:, None, :, t0:t1]
        mnew = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(mnew), torch.zeros_like(mnew), mnew)
        corr = torch.exp(m - safe)
        p = torch.exp(s - safe.unsqueeze(-1))
        l = l * corr + p.sum(-1)
        acc = acc * corr.unsqueeze(-1) + p @ v
        m = mnew
    out = torch.where(l.unsqueeze(-1) > 0, acc / l.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(acc))
    return out, torch.where(l > 0, m + torch.log(l.clamp_min(1e-30)), torch.full_like(l, float("-inf")))
