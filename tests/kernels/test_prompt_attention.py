"""The bf16 prompt-attention kernel (``kernels.prompt_attention``, CPUs with AVX512-BF16).

Against the float32 formula over the same bf16-rounded q, k and v (the kernel rounds only
the probabilities to bf16 for the weighted sum of the values); a causal row equals the same
row attending, without a mask, to the keys it can see (bit for bit: nothing past its last
key moves it), and a row does not depend on the rows beside it. Where the kernel does not
run (no AVX512-BF16 here) these skip and ``kvcache.view`` keeps torch's flash attention
(``test_view_falls_back_without_the_kernel`` runs everywhere).
"""

from __future__ import annotations

import pytest
import torch

from lessmem.kernels import prompt_attention as PA
from lessmem.kvcache import view as V

needs_kernel = pytest.mark.skipif(not PA.available(), reason="the CPU has no AVX512-BF16 (or no compiler)")


def _reference(q, k, v, scale, causal):
    q, k, v = (x.to(torch.bfloat16).double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    Tq, N = q.shape[2], k.shape[2]
    if causal:
        seen = torch.arange(N)[None, :] <= torch.arange(Tq)[:, None] + (N - Tq)
        s = s.masked_fill(~seen, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


CASES = [  # B, Hq, Hkv, Tq, N, D, causal
    (1, 9, 3, 37, 37, 64, True),     # a first chunk: causal over itself
    (1, 9, 3, 100, 250, 64, True),   # after a window: tiles past a row's last key skipped
    (2, 4, 4, 5, 70, 128, False),    # batch of two, no GQA, head size 128
    (1, 9, 3, 64, 1000, 64, False),  # a history slice: every row sees every key
    (1, 2, 1, 1, 1, 64, True),       # one query, one key
    (1, 6, 2, 19, 130, 64, True),    # rows not a multiple of the kernel's four
]


@needs_kernel
@pytest.mark.parametrize("B,Hq,Hkv,Tq,N,D,causal", CASES)
def test_kernel_matches_the_formula(B, Hq, Hkv, Tq, N, D, causal):
    g = torch.Generator().manual_seed(Tq * 7 + N)
    q = torch.randn(B, Hq, Tq, D, generator=g) * 2
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    out, lse = PA.bf16_attention(q, k, v, D ** -0.5, causal)
    ref, ref_lse = _reference(q, k, v, D ** -0.5, causal)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:3]
    assert (lse.double() - ref_lse).abs().max() < 1e-4  # scores: exact products, float32 sums
    assert (out.double() - ref).abs().max() < 6e-3  # probabilities rounded to bf16 (2^-9) in Σ p·v


@needs_kernel
def test_a_causal_row_is_the_row_over_the_keys_it_sees():
    g = torch.Generator().manual_seed(3)
    Tq, N = 90, 200
    q, k, v = torch.randn(1, 6, Tq, 64, generator=g), torch.randn(1, 2, N, 64, generator=g), torch.randn(1, 2, N, 64, generator=g)
    out, lse = PA.bf16_attention(q, k, v, 0.125, causal=True)
    for t in (0, 1, 45, 63, 64, 89):
        n = N - Tq + t + 1  # the row's keys: everything up to itself
        o1, l1 = PA.bf16_attention(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], 0.125)
        assert torch.equal(out[:, :, t:t + 1], o1) and torch.equal(lse[:, :, t:t + 1], l1)
    # and rows do not depend on the rows computed beside them
    o2, l2 = PA.bf16_attention(q[:, :, 30:33], k[:, :, :N - Tq + 33], v[:, :, :N - Tq + 33], 0.125, causal=True)
    assert torch.equal(out[:, :, 30:33], o2) and torch.equal(lse[:, :, 30:33], l2)


@needs_kernel
def test_causal_needs_as_many_keys_as_queries():
    q, k = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="at least as many keys"):
        PA.bf16_attention(q, k, k, 0.125, causal=True)


def test_supports_only_what_the_kernel_is_built_for():
    q, k = torch.randn(1, 4, 20, 80), torch.randn(1, 2, 30, 80)
    assert not PA.supports(q, k)  # head size 80
    assert not PA.supports(torch.randn(1, 3, 20, 64), torch.randn(1, 2, 30, 64))  # heads not a multiple
    assert PA.supports(torch.randn(1, 4, 20, 64), torch.randn(1, 2, 30, 64)) == PA.available()


@pytest.mark.parametrize("history", [False, True])
def test_view_falls_back_without_the_kernel(history, monkeypatch):
    """A prompt chunk's attention in bf16 through ``LayerView.attend`` (no history: causal
    over itself; with a quantized history: the history's slices and the causal part merged)
    is the same with the kernel as with torch's flash attention, to bf16's precision."""
    from lessmem.kvcache import KVCache
    from lessmem.models import tiny_random

    model = tiny_random("llama", hidden_size=256, num_heads=4, num_kv_heads=2)
    layer = KVCache(model.config, "best-4", attention="fused").layers[0]
    g = torch.Generator().manual_seed(5)
    Tq, H, Hkv, D = 40, 4, 2, 64
    if history:  # 300 tokens before the chunk: a quantized history and a window
        layer.update(torch.randn(1, Hkv, 300, D, generator=g), torch.randn(1, Hkv, 300, D, generator=g))
    q = torch.randn(1, H, Tq, D, generator=g)
    view = layer.update(torch.randn(1, Hkv, Tq, D, generator=g), torch.randn(1, Hkv, Tq, D, generator=g))[0]
    assert isinstance(view, V.LayerView)
    assert (view.n_history > 0) == history
    ran = PA.available()
    token = V.PROMPT_BF16.set(True)
    try:
        got = view.attend(q, None, D ** -0.5)
        monkeypatch.setattr(PA, "available", lambda: False)
        ref = view.attend(q, None, D ** -0.5)
    finally:
        V.PROMPT_BF16.reset(token)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got - ref).abs().max() < 2e-2
    assert torch.equal(got, ref) != ran  # the kernel took the call where it runs (other roundings)
