"""The lean decode step (``lessmem.decode``): bit-identical logits to transformers' forward on
every supported architecture and cache, and the model's own forward wherever it cannot apply."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from test_architectures import model_for
from transformers import DynamicCache

import lessmem
from lessmem.decode import lean_decode, lean_disable, why_not
from lessmem.kvcache import KVCache, enable
from lessmem.models import tiny_random

PROMPT = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(1))
STEPS = [7, 99, 12, 250, 3]


def _decode(model, cache, lean: bool, steps=STEPS, prompt=PROMPT, **kw):
    """Logits of each decode step after a prefill, with or without the switch."""
    handle = lean_decode(model) if lean else None
    out = []
    try:
        with torch.no_grad(), enable(model):
            model(prompt, cache=cache)
            for t in steps:
                out.append(model(torch.tensor([[t]] * prompt.shape[0]), cache=cache, **kw).logits)
    finally:
        if handle is not None:
            handle.disable()
    return torch.cat(out, 1), handle


def _cache(model, kind):
    """A DynamicCache, or a lessmem preset with a short window so the prompt fills a
    quantized history (the fused kernel's path, not only the full-precision window)."""
    if kind == "dynamic":
        return DynamicCache()
    from lessmem.kvcache import PRESETS

    return KVCache(model.config, dataclasses.replace(PRESETS[kind], window=8, block_size=64))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("kind", ["dynamic", "int8", "best-4"])
def test_bit_identical_to_transformers(arch, kind):
    model = tiny_random(arch)
    ref, _ = _decode(model, _cache(model, kind), lean=False)
    got, handle = _decode(model, _cache(model, kind), lean=True)
    assert handle.steps == len(STEPS)
    if kind == "dynamic":  # one_token_attention: the same sums in another order
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    else:
        assert torch.equal(got, ref)


def test_qk_norm_and_biases():
    """Qwen3 (QK-norm) and Qwen2 with outlier key biases, from the real transformers classes."""
    for arch in ("qwen3", "qwen2+outliers"):
        model = model_for(arch)
        assert why_not(model) is None
        ref, _ = _decode(model, _cache(model, "best-4"), lean=False)
        got, handle = _decode(model, _cache(model, "best-4"), lean=True)
        assert handle.steps == len(STEPS) and torch.equal(got, ref)


@pytest.fixture
def sdpa_as_transformers(monkeypatch):
    """DynamicCache rows attend as transformers does (``enable_gqa``), so tests of the
    projections can ask for bit-identical logits (one_token_attention sums in another order)."""
    from lessmem import decode

    monkeypatch.setattr(decode, "one_token_attention", lambda q, k, v, scale: torch.nn.functional.
                        scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1]))


def test_gguf_weights_int8_activations(sdpa_as_transformers):
    """GGUF linears through their op, int8 activations on: still bit-identical (a rounding
    difference before an int8 quantizer would show as a large logit difference)."""
    model = tiny_random("llama", hidden_size=64, intermediate_size=128)
    lessmem.quantize_(model, lessmem.GGUFConfig("Q4_0"))
    from lessmem.weights.gguf_linear import GGUFLinear, set_int8_activations

    assert set_int8_activations(model, True) > 0
    assert isinstance(model.model.layers[0].self_attn.q_proj, GGUFLinear)
    for kind in ("dynamic", "best-4"):
        ref, _ = _decode(model, _cache(model, kind), lean=False)
        got, handle = _decode(model, _cache(model, kind), lean=True)
        assert handle.steps == len(STEPS) and torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_mix_in_one_call_per_projection_group(arch, sdpa_as_transformers):
    """q/k/v and gate/up as one C++ call each (``gguf_linear_multi``), RMSNorm and the
    rotary embedding in C++: bit-identical with a K-quant mix (v and down in Q6_K), Qwen2's
    q/k/v biases, three rows, both activation paths; without the C++ module the step still
    runs, with the same logits."""
    from lessmem.weights.gguf_linear import set_int8_activations

    model = tiny_random(arch, hidden_size=256, intermediate_size=512)
    lessmem.quantize_(model, lessmem.GGUFConfig("Q4_K_M"))
    types = {m.gguf_type for m in model.modules() if hasattr(m, "gguf_type")}
    assert {"q4_k", "q6_k"} <= types, types
    prompt = torch.randint(3, 250, (3, 20), generator=torch.Generator().manual_seed(4))
    for int8 in (False, True):
        set_int8_activations(model, int8)
        for kind in ("dynamic", "best-4"):
            ref, _ = _decode(model, _cache(model, kind), lean=False, prompt=prompt)
            got, handle = _decode(model, _cache(model, kind), lean=True, prompt=prompt)
            assert handle.steps == len(STEPS) and torch.equal(got, ref), (int8, kind)
            if handle._glue is not None:  # the C++ glue was built: it was the path taken
                assert all(L.qkv is not None and L.gate_up is not None for L in handle._layers)
    import lessmem.decode as dec

    real = dec._glue
    dec._glue = lambda: None
    try:
        got, handle = _decode(model, _cache(model, "best-4"), lean=True, prompt=prompt)
    finally:
        dec._glue = real
    assert handle._layers[0].qkv is None and torch.equal(got, ref)


def test_gguf_file_rows_in_llamacpp_order(tmp_path, sdpa_as_transformers):
    """A model loaded from a GGUF file keeps llama.cpp's q/k row order (``out_perm``); the
    fused q/k/v call gathers its outputs in C++: the same logits as the model's forward."""
    from lessmem.weights.gguf_export import write_model_gguf
    from lessmem.weights.gguf_load import load_gguf_blocks

    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    g = load_gguf_blocks(write_model_gguf(m, tmp_path / "m.gguf", "q8_0"), config=m.config)
    assert g.model.layers[0].self_attn.q_proj.out_perm is not None
    for kind in ("dynamic", "best-4"):
        ref, _ = _decode(g, _cache(g, kind), lean=False)
        got, handle = _decode(g, _cache(g, kind), lean=True)
        assert handle.steps == len(STEPS) and torch.equal(got, ref), kind
        if handle._glue is not None:
            assert all(L.qkv is not None for L in handle._layers)


@pytest.mark.parametrize("preset", ["best-4", "int4-rot", "kivi-2"])
def test_decode_row_equals_the_view_path(preset):
    """``QuantizedKVLayer.decode_row`` (the lean step's append + attention) gives what
    ``append_view(k, v).attend(q)`` gives, bit for bit, and leaves the same layer: while
    the sinks fill, before the first block is quantized and across block flushes."""
    from lessmem.kvcache import PRESETS

    cfg = dataclasses.replace(PRESETS[preset], sinks=3, window=8, block_size=64)
    model = tiny_random("llama")
    a, b = KVCache(model.config, cfg).layers[0], KVCache(model.config, cfg).layers[0]
    g = torch.Generator().manual_seed(5)
    Hq, Hkv, D = model.config.num_attention_heads, model.config.num_key_value_heads, 16
    k0, v0 = torch.randn(1, Hkv, 2, D, generator=g), torch.randn(1, Hkv, 2, D, generator=g)
    a.update(k0, v0), b.update(k0.clone(), v0.clone())
    for step in range(150):
        q, k, v = (torch.randn(1, h, 1, D, generator=g) for h in (Hq, Hkv, Hkv))
        got = a.decode_row(q, k, v, 0.25)
        ref = b.append_view(k.clone(), v.clone()).attend(q, None, 0.25)
        assert torch.equal(got, ref), step
        assert (a.length, a.n_history) == (b.length, b.n_history)
        assert all(torch.equal(x, y) for x, y in zip(a.window + a.sinks, b.window + b.sinks, strict=True))
    assert a.n_history >= 128


def test_batch_rows(sdpa_as_transformers):
    model = tiny_random("llama")
    prompt = torch.randint(3, 250, (3, 20), generator=torch.Generator().manual_seed(2))
    ref, _ = _decode(model, DynamicCache(), lean=False, prompt=prompt)
    got, handle = _decode(model, DynamicCache(), lean=True, prompt=prompt)
    assert handle.steps == len(STEPS) and torch.equal(got, ref)


@pytest.mark.parametrize("case", ["mask_with_padding", "two_tokens", "output_attentions", "hook",
                                  "training", "other_position"])
def test_falls_back_to_the_model_forward(case):
    model = tiny_random("llama")
    handle = lean_decode(model)
    cache = DynamicCache()
    with torch.no_grad():
        model(PROMPT, cache=cache)
        ids, kw = torch.tensor([[5]]), {}
        if case == "mask_with_padding":
            kw["attention_mask"] = torch.cat([torch.zeros(1, 1), torch.ones(1, PROMPT.shape[1])], 1).long()
        elif case == "two_tokens":
            ids = torch.tensor([[5, 6]])
        elif case == "output_attentions":
            kw["output_attentions"] = True
        elif case == "hook":
            model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
        elif case == "training":
            model.train()
        elif case == "other_position":
            kw["position_ids"] = torch.tensor([[3]])
        model(ids, cache=cache, **kw)
    assert handle.steps == 0


def test_mask_of_ones_and_generate_take_the_step():
    model = tiny_random("llama")
    enc = {"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT)}
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=6, do_sample=False)
        with lean_decode(model) as handle:
            got = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert handle.steps == 5 and torch.equal(got, ref)
    assert "forward" not in model.__dict__  # disabled on leaving the block


def test_rebuilds_after_a_module_is_replaced():
    model = tiny_random("llama")
    handle = lean_decode(model)
    _decode(model, DynamicCache(), lean=False)  # the switch is on: gathers the modules
    lessmem.quantize_(model, lessmem.RTNConfig(bits=4, group_size=32))
    got, _ = _decode(model, DynamicCache(), lean=False)  # gathers the quantized ones
    handle.disable()
    ref, _ = _decode(model, DynamicCache(), lean=False)
    assert handle.steps == 2 * len(STEPS) and torch.equal(got, ref)


def test_copies_use_their_own_weights(sdpa_as_transformers):
    model = tiny_random("llama")
    handle = lean_decode(model)
    _decode(model, DynamicCache(), lean=False)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            twin.lm_head.weight.mul_(2.0)
        lean = twin._lessmem_lean
        assert lean is not handle and lean.model is twin
        got, _ = _decode(twin, DynamicCache(), lean=False)
        lean.disable()
        ref, _ = _decode(twin, DynamicCache(), lean=False)
        assert lean.steps == len(STEPS) and torch.equal(got, ref)
    assert handle.steps == len(STEPS)  # the copies' steps were not the original's


def test_refusals():
    for arch in ("phi", "mixtral"):
        reason = why_not(model_for(arch))
        assert reason is not None
        with pytest.raises(ValueError, match="cannot take the lean step"):
            lean_decode(model_for(arch))
    sliding = tiny_random("mistral", sliding_window=8)
    assert "sliding" in why_not(sliding)
    model = tiny_random("llama")
    model.forward = lambda *a, **k: None
    assert "replaced on the instance" in why_not(model)


def test_switch_is_idempotent_and_reversible():
    model = tiny_random("llama")
    a = lean_decode(model)
    assert lean_decode(model) is a
    assert lean_disable(model) and not lean_disable(model)
    assert "forward" not in model.__dict__ and "_lessmem_lean" not in model.__dict__


@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (8, 8)])
@pytest.mark.parametrize("T", [5, 300, 301, 1300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_attention_equals_sdpa_with_gqa(monkeypatch, heads, T, dtype):
    """The query heads of a KV head as its rows, and a long history cut into pieces merged
    by their log-sum-exp (pieces of >= 128 tokens here), read in place from the first T
    tokens of a longer buffer: equal to SDPA with ``enable_gqa`` up to rounding."""
    from lessmem import decode

    monkeypatch.setattr(decode, "SPLIT_PIECE_TOKENS", 128)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the pieces are chosen for two threads
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(T)
    kb, vb = (torch.randn(1, Hkv, T + 9, 64, generator=g).to(dtype) for _ in range(2))
    k, v = kb[:, :, :T], vb[:, :, :T]
    for B in (1, 2):
        q = torch.randn(B, Hq, 1, 64, generator=g).to(dtype)
        kk, vv = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), vv.float(), scale=0.125,
                                                               enable_gqa=True)
        got = decode.one_token_attention(q, kk, vv, 0.125)
        assert got.dtype == dtype and got.shape == q.shape
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), ref, rtol=0, atol=tol)
    if T >= 256 and Hkv < 8:  # the split path was taken (its pieces are a strided view)
        assert decode._split_pieces(Hkv, T) > 1
    # heads interleaved in memory ([1, T, Hkv, D] transposed): the pieces' strides follow
    kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    q = torch.randn(1, Hq, 1, 64, generator=g).to(dtype)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125,
                                                           enable_gqa=True)
    torch.testing.assert_close(decode.one_token_attention(q, kt, vt, 0.125).float(), ref, rtol=0, atol=tol)


def test_dynamic_cache_grows_in_place_and_stays_a_dynamic_cache():
    """The lean step appends to a DynamicCache layer in a buffer with room to grow; whatever
    transformers does to the layer in between (its own update, crop) is adopted anew."""
    model = tiny_random("llama")
    ref_cache, cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(PROMPT, cache=ref_cache)
        with lean_decode(model) as handle:
            model(PROMPT, cache=cache)
            for i, t in enumerate(STEPS * 20):  # 100 steps: the buffer grows more than once
                if i == 50:  # transformers' own path (two tokens) and a crop in between
                    for c in (ref_cache, cache):
                        model(torch.tensor([[4, 5]]), cache=c)
                        c.crop(-1)
                got = model(torch.tensor([[t]]), cache=cache).logits
                handle.disable()
                ref = model(torch.tensor([[t]]), cache=ref_cache).logits
                handle = lean_decode(model)
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=str(i))
                layer = cache.layers[0]
                assert layer.keys.shape == ref_cache.layers[0].keys.shape
                assert torch.equal(layer.keys, ref_cache.layers[0].keys)
    buf = cache.layers[0].__dict__["_lessmem_buf"][0]  # grown in place: a view of a longer buffer
    assert cache.layers[0].keys.data_ptr() == buf.data_ptr() and buf.shape[2] > cache.get_seq_length()
    assert cache.get_seq_length() == PROMPT.shape[1] + 101


@pytest.mark.parametrize("rotate", [(True, False), (False, True), (True, True)])
def test_rotated_keys_and_values_match_the_dequantized_path(rotate):
    """The one-call decode row (queries scaled and rotated, values un-rotated inside the C++
    call) against the dequantized path on the same cache config."""
    from lessmem.kvcache import PRESETS

    model = tiny_random("llama", num_layers=2)
    cfg = dataclasses.replace(PRESETS["best-4"], window=8, block_size=64, rotate_keys=rotate[0],
                              rotate_values=rotate[1])
    ref, _ = _decode(model, KVCache(model.config, cfg, attention="reference"), lean=False)
    got, handle = _decode(model, KVCache(model.config, cfg), lean=True)
    assert handle.steps == len(STEPS)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def test_sees_int8_activations_switched_after_the_switch(sdpa_as_transformers):
    model = tiny_random("llama", hidden_size=64, intermediate_size=128)
    lessmem.quantize_(model, lessmem.GGUFConfig("Q4_0"))
    from lessmem.weights.gguf_linear import set_int8_activations

    set_int8_activations(model, True)
    handle = lean_decode(model)
    _decode(model, DynamicCache(), lean=False)  # gathered with int8 activations on
    set_int8_activations(model, False)
    got, _ = _decode(model, DynamicCache(), lean=False)
    handle.disable()
    ref, _ = _decode(model, DynamicCache(), lean=False)
    assert handle.steps == 2 * len(STEPS) and torch.equal(got, ref)


@pytest.mark.parametrize("kind", ["dynamic", "best-4", "gguf+best-4"])
def test_bf16_embedding_with_float32_layers(kind, sdpa_as_transformers):
    """An embedding kept in bf16 before float32 layers (the step decides its C++ glue once,
    from the embedding's dtype, so the whole step takes the torch ops, with GGUF linears
    their fused q/k/v and gate/up calls split in torch): the same logits as transformers'
    forward (bit for bit with a lessmem cache)."""
    model = tiny_random("llama", hidden_size=64, intermediate_size=128)
    if kind.startswith("gguf+"):
        lessmem.quantize_(model, lessmem.GGUFConfig("Q4_0"))
        kind = kind[5:]
    model.model.embed_tokens.to(torch.bfloat16)
    ref, _ = _decode(model, _cache(model, kind), lean=False)
    got, handle = _decode(model, _cache(model, kind), lean=True)
    assert handle.steps == len(STEPS) and got.dtype == ref.dtype == torch.float32
    if kind == "dynamic":
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    else:
        assert torch.equal(got, ref)


def test_heap_trimmed_after_each_step_that_moves_blocks_into_the_history(monkeypatch):
    # the pieces a flush replaced go back to the OS once per flush, not every step (the trim
    # costs ~3 ms): counted against the steps where the first layer's history grew
    import lessmem.decode as dec

    trims = []
    monkeypatch.setattr(dec, "trim_heap", lambda: trims.append(1) or True)
    model = tiny_random("llama")
    cache = KVCache(model.config, dataclasses.replace(lessmem.kvcache.PRESETS["int8"], window=8, block_size=16))
    with torch.no_grad(), enable(model), lean_decode(model) as handle:
        model(PROMPT, cache=cache)
        prefill_trims, grew = len(trims), 0
        for t in range(40):
            before = cache.layers[0].n_history
            model(torch.tensor([[3 + t]]), cache=cache)
            grew += cache.layers[0].n_history != before
        other = KVCache(model.config, "int8")  # a new cache: its first step is no flush of the last one's
        model(PROMPT[:, :4], cache=other)
        n = len(trims)
        model(torch.tensor([[5]]), cache=other)
    assert handle.steps == 41 and prefill_trims == 1 and 2 <= grew < 40
    assert n - prefill_trims == grew + 1 and len(trims) == n  # (+1: the second prefill)


def test_dynamic_cache_buffers_that_grow_trim_the_heap(monkeypatch):
    # a layer moved to bigger buffers frees the old ones: the heap is trimmed right after
    # (else the first step after a prefill held the old KV and the new at once), but only
    # for buffers of TRIM_GROWN_BYTES or more (a trim costs ms; small contexts grow often)
    import lessmem.decode as dec

    trims = []
    monkeypatch.setattr(dec, "trim_heap", lambda: trims.append(1) or True)
    model = tiny_random("llama")
    n_layers = model.config.num_hidden_layers
    for limit, want_trims in ((1 << 60, False), (0, True)):
        monkeypatch.setattr(dec, "TRIM_GROWN_BYTES", limit)
        cache = DynamicCache()
        with torch.no_grad(), lean_decode(model):
            model(PROMPT, cache=cache)
            trims.clear()
            grown = []
            for t in range(80):
                before = cache.layers[0].__dict__.get("_lessmem_buf")
                model(torch.tensor([[3 + t]]), cache=cache)
                grown.append(cache.layers[0].__dict__["_lessmem_buf"][0] is not (before or (None,))[0])
        assert grown[0] and 2 <= sum(grown) < 80  # the first step adopts the prefill's KV, then growth
        assert len(trims) == (n_layers * sum(grown) if want_trims else 0)
