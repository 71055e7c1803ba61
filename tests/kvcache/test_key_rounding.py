"""key_rounding="attention": per-channel integer keys rounded for the scores (GPTQ under the
queries' second moment) — the same stored layout, fewer score errors, wired into the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lessmem.formats import PerGroup
from lessmem.kernels.attention import QuantSide
from lessmem.kvcache import KVCache, KVConfig, enable
from lessmem.kvcache.codec import encode, kv_layout
from lessmem.kvcache.config import KVTensorConfig
from lessmem.kvcache.key_rounding import MIN_ROWS, QueryMoments, applies, round_keys
from lessmem.kvcache.presets import resolve
from lessmem.models import tiny_random


def _deq(e, spec, D):
    return QuantSide(e.codes, e.scale, e.zero_point, kv_layout(spec, D)).dequantize()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fewer_score_errors_same_scales(bits):
    g = torch.Generator().manual_seed(bits)
    H, T, D = 2, 128, 32
    spec = KVTensorConfig("uint", bits, PerGroup(64, axis=-2))
    mix = torch.randn(H, 4, D, generator=g)  # queries near a 4-dimensional subspace per head
    q = torch.randn(H, 2048, 4, generator=g) @ mix + 0.05 * torch.randn(H, 2048, D, generator=g)
    k = torch.randn(1, H, T, D, generator=g) * torch.linspace(0.2, 2, D)
    m = QueryMoments(H, D)
    m.add(q.unsqueeze(0))
    near = encode(k, spec)
    tuned = round_keys(k, near, spec, m.factor(None))
    assert torch.equal(tuned.scale, near.scale) and torch.equal(tuned.zero_point, near.zero_point)
    err = [((_deq(e, spec, D) - k)[0] @ q.transpose(1, 2)).pow(2).mean().item() for e in (near, tuned)]
    assert err[1] < 0.7 * err[0]


def test_isotropic_queries_round_to_nearest():
    # Σ ∝ I: no channel's error is worth moving into another, so the codes are the nearest ones
    spec = KVTensorConfig("uint", 3, PerGroup(32, axis=-2))
    k = torch.randn(1, 1, 64, 16, generator=torch.Generator().manual_seed(0))
    m = QueryMoments(1, 16)
    m.add(torch.eye(16).repeat(8, 1).view(1, 1, -1, 16))
    assert torch.equal(round_keys(k, encode(k, spec), spec, m.factor(None)).codes, encode(k, spec).codes)


def test_moments_need_rows_and_stop_at_the_cap():
    m = QueryMoments(3, 8)
    assert m.factor(None) is None
    m.add(torch.randn(1, 6, MIN_ROWS // 2 - 1, 8))  # 2 query heads per KV head
    assert m.rows == MIN_ROWS - 2 and m.factor(None) is None
    m.add(torch.randn(1, 6, 4000, 8))
    assert m.full and m.factor(None).shape == (3, 8, 8)
    rows = m.rows
    m.add(torch.randn(1, 6, 10, 8))
    assert m.rows == rows  # full: later queries are not added


def test_which_sides_and_configs():
    assert applies(KVTensorConfig("uint", 4, PerGroup(64, axis=-2)))
    assert not applies(KVTensorConfig("uint", 4))  # per token
    assert not applies(KVTensorConfig("lm", 3, PerGroup(64, axis=-2)))
    assert not applies(KVTensorConfig("uint", 4, PerGroup(64, axis=-2), channel_bits=(4,) * 8 + (2,) * 8))
    c = resolve("best-4:key_rounding=attention")
    assert c.key_rounding == "attention" and KVConfig.from_dict(c.to_dict()) == c
    d = resolve("best-4").to_dict()
    del d["key_rounding"]  # a file written before the field: nearest, as it was measured
    assert KVConfig.from_dict(d).key_rounding == "nearest"
    with pytest.raises(ValueError, match="key_rounding='gptq'; allowed: nearest, attention"):
        KVConfig(key_rounding="gptq")


def test_cache_rounds_keys_once_it_has_seen_queries():
    torch.manual_seed(0)
    model = tiny_random("llama")
    cfg = resolve("best-4:window=16:key_rounding=attention")
    ids = torch.randint(1, model.config.vocab_size, (1, 160))
    caches = {"dyn": DynamicCache(), "near": KVCache(model.config, resolve("best-4:window=16")),
              "attn": KVCache(model.config, cfg)}
    logits = {}
    with torch.inference_mode(), enable(model):
        for name, c in caches.items():
            out = [model(ids[:, :96], past_key_values=c, use_cache=True).logits]
            out += [model(ids[:, t:t + 1], past_key_values=c, use_cache=True).logits for t in range(96, 160)]
            logits[name] = torch.cat(out, 1)
    layer, near = caches["attn"].layers[0], caches["near"].layers[0]
    assert layer.queries.rows >= 96 * model.config.num_attention_heads // model.config.num_key_value_heads
    assert near.queries is None
    h, hn = layer.history, near.history
    n0 = 64  # the first block was flushed by the prefill, before any query was seen: nearest
    assert torch.equal(h["k_codes"][:, :, :n0], hn["k_codes"][:, :, :n0])
    assert torch.equal(h["k_scale"], hn["k_scale"]) and torch.equal(h["v_codes"], hn["v_codes"])
    assert not torch.equal(h["k_codes"][:, :, n0:], hn["k_codes"][:, :, n0:])
    # still a faithful cache (scores through the same kernels): close to DynamicCache
    p = logits["dyn"].log_softmax(-1)
    kl = {n: (p.exp() * (p - logits[n].log_softmax(-1))).sum(-1).mean().item() for n in ("near", "attn")}
    assert kl["attn"] < 1e-2 and kl["near"] < 1e-2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_cpp_kernel_equals_the_torch_loop(bits):
    from lessmem.kvcache.key_rounding import _cpp

    if _cpp() is None:
        pytest.skip("no C++ compiler: the torch loop runs (tested above)")
    g = torch.Generator().manual_seed(10 + bits)
    spec = KVTensorConfig("uint", bits, PerGroup(32, axis=-2))
    k = torch.randn(2, 3, 96, 64, generator=g)
    m = QueryMoments(3, 64)
    m.add(torch.randn(2, 9, 300, 64, generator=g) @ torch.randn(64, 64, generator=g))
    enc = encode(k, spec)
    a = round_keys(k, enc, spec, m.factor(None))
    b = round_keys(k, enc, spec, m.factor(None), use_cpp=False)
    assert torch.equal(a.codes, b.codes)
