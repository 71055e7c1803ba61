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


CASES = [  # B, Hq, Hkv, Tq, N, D, causal
    (1, 9, 3, 37, 37, 64, True),     # a first chunk: causal over itself
    (1, 9, 3, 100, 250, 64, True),   # after a window: tiles past a row's last key skipped
    (2, 4, 4, 5, 70, 128, False),    # batch of two, no GQA, head size 128
    (1, 9, 3, 64, 1000, 64, False),  # a history slice: every row sees every key
    (1, 2, 1, 1, 1, 64, True),       # one query, one key
    (1, 6, 2, 19, 130, 64, True),    # rows not a multiple of the kernel's four
    (1, 4, 1, 33, 90, 256, True),    # one KV head of 256 (Gemma)
]


@needs_kernel
@pytest.mark.parametrize("B,Hq,Hkv,Tq,N,D,causal", CASES)
def test_kernel_matches_the_formula(B, Hq, Hkv, Tq, N, D, causal):
    g = torch.Generator().manual_seed(Tq * 7 + N)
    q = torch.randn(B, Hq, Tq, D, generator=g) * 2
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    out, lse = PA.bf16_attention(q, k, v, D ** -0.5, causal)
    ref, ref_lse = PA.reference_attention(q, k, v, D ** -0.5, causal)
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


def test_plain_tensors_take_the_kernel_only_where_sdpa_would_be_plain(monkeypatch):
    """``kvcache.attention`` (a DynamicCache or no cache) hands a bf16 prompt chunk to the
    kernel only for what it computes the same: no mask and as many queries as keys (causal,
    or not where the module is not causal), or a plain causal bool mask; never a padded mask,
    dropout, a position bias, or a causal chunk after a history without a mask (SDPA's
    is_causal aligns that top-left)."""
    from types import SimpleNamespace

    from lessmem.kvcache.attention import _kernel_causal

    monkeypatch.setattr(PA, "available", lambda: True)  # the decisions, not the kernel
    causal_mod, plain_mod = SimpleNamespace(is_causal=True), SimpleNamespace(is_causal=False)
    q, k = torch.randn(1, 4, 32, 64), torch.randn(1, 2, 32, 64)
    k_long = torch.randn(1, 2, 48, 64)
    tail = torch.ones(32, 48, dtype=torch.bool).tril(16)[None, None]
    padded = tail.clone()
    padded[..., 0] = False
    token = V.PROMPT_BF16.set(True)
    try:
        assert _kernel_causal(causal_mod, q, k, None, 0.0, None, {}) is True
        assert _kernel_causal(plain_mod, q, k, None, 0.0, None, {}) is False
        assert _kernel_causal(causal_mod, q, k, None, 0.0, False, {}) is False  # the call's flag first
        assert _kernel_causal(causal_mod, q, k_long, None, 0.0, None, {}) is None
        assert _kernel_causal(causal_mod, q, k_long, tail, 0.0, None, {}) is True
        assert _kernel_causal(causal_mod, q, k_long, padded, 0.0, None, {}) is None
        assert _kernel_causal(causal_mod, q, k, None, 0.1, None, {}) is None
        assert _kernel_causal(causal_mod, q, k, None, 0.0, None, {"position_bias": torch.zeros(1)}) is None
        assert _kernel_causal(causal_mod, q, torch.randn(1, 2, 32, 80), None, 0.0, None, {}) is None
    finally:
        V.PROMPT_BF16.reset(token)
    assert _kernel_causal(causal_mod, q, k, None, 0.0, None, {}) is None  # float32 prompt: SDPA


@needs_kernel
def test_a_dynamic_cache_prompt_is_sdpa_to_bf16_precision(monkeypatch, tmp_path):
    """A model on plain tensors (DynamicCache), bf16 prompt rows: three 40-token chunks'
    logits with the kernel against SDPA's bf16 flash attention."""
    from transformers import DynamicCache

    import lessmem.weights.gguf_linear as gl
    from lessmem.kvcache import enable
    from lessmem.models import tiny_random
    from lessmem.weights.gguf_export import write_model_gguf
    from lessmem.weights.gguf_load import load_gguf_blocks

    torch.manual_seed(0)
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    model = load_gguf_blocks(write_model_gguf(m, tmp_path / "m.gguf", "q8_0"), config=m.config)
    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", True)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    calls = []
    kernel = PA.bf16_attention
    monkeypatch.setattr(PA, "bf16_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))

    def run():
        cache, out = DynamicCache(), []
        with torch.no_grad(), enable(model):
            for s in range(0, 120, 40):
                out.append(model(ids[:, s:s + 40], past_key_values=cache).logits)
        return torch.cat(out, 1)

    got = run()
    assert len(calls) == 2 * 3  # two layers, three chunks, each chunk after the first a plain causal mask
    monkeypatch.setattr(PA, "available", lambda: False)
    ref = run()
    assert len(calls) == 6 and not torch.equal(got, ref)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


def test_cpus_with_amx_keep_torchs_flash_attention(monkeypatch):
    """Where the CPU has AMX-BF16, torch's flash attention runs on oneDNN's AMX tiles: the
    kernel steps aside (``available`` false, so ``supports`` too) whatever else the CPU has."""
    monkeypatch.setattr(PA, "_has_amx_bf16", lambda: True)
    assert not PA.available()
    assert not PA.supports(torch.randn(1, 4, 20, 64), torch.randn(1, 2, 30, 64))


def test_cpu_capability_is_torchs_report_read_once():
    from lessmem.kernels._build import cpu_capability

    got = cpu_capability()
    assert got is cpu_capability()  # cached: the kernel's gate is asked before every prompt chunk's attention
    assert got == dict(torch._C._cpu._get_cpu_capability())
