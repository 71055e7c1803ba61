"""A layer's history held in pieces (``SEGMENT_TOKENS``) reads, counts and copies like one piece."""

from __future__ import annotations

import pytest
import torch

from lessmem.kernels.attention import SegmentedKV
from lessmem.kvcache import KVCache, enable
from lessmem.kvcache.layer import QuantizedKVLayer
from lessmem.kvcache.presets import resolve
from lessmem.models import tiny_random


def _run(model, spec, ids):
    cache = KVCache(model.config, resolve(spec))
    with torch.inference_mode(), enable(model):
        out = [model(ids[:, :150], cache=cache, use_cache=True).logits]  # a prefill chunk
        out += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits
                for t in range(150, ids.shape[1])]
    return cache, torch.cat(out, 1)


@pytest.mark.parametrize("spec", ["best-4:window=16", "int8:window=16"])
def test_history_in_pieces_reads_like_one_piece(monkeypatch, spec):
    torch.manual_seed(0)
    model = tiny_random("llama")
    ids = torch.randint(1, model.config.vocab_size, (1, 420))
    monkeypatch.setattr(QuantizedKVLayer, "segment_tokens", None)
    whole, ref = _run(model, spec, ids)
    B = whole.kv_config.block_size
    monkeypatch.setattr(QuantizedKVLayer, "segment_tokens", 2 * B)
    cache, got = _run(model, spec, ids)
    layer, one = cache.layers[0], whole.layers[0]
    assert len(one._pieces) == 1 and len(layer._pieces) >= 3
    assert all(layer._n_tokens(p) == 2 * B for p in layer._pieces[:-1])
    assert isinstance(layer.read_history(), SegmentedKV) and layer.read_history() is layer.read_history()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)  # the kernels walk the pieces in place
    assert cache.memory() == whole.memory()  # the same bytes, counted from the pieces
    for name, t in one.history.items():
        assert torch.equal(layer.history[name], t)
    for a, b in zip(one.blocks(), layer.blocks(), strict=True):
        assert a.start == b.start and all(torch.equal(t, b.tensors_[n]) for n, t in a.tensors_.items())
    layer.batch_repeat_interleave(2)  # batch operations map every piece
    assert len(layer._pieces) >= 3 and layer.history["k_codes"].shape[0] == 2
    layer.history = one.history  # set whole: split into pieces again
    assert len(layer._pieces) >= 3 and torch.equal(layer.history["v_codes"], one.history["v_codes"])


def test_window_is_written_in_place_without_touching_earlier_views():
    """The window grows inside a buffer of its tokens rounded up to ``WINDOW_GRAIN``: a step
    writes past its end, so what an earlier view (a step's LayerView, a serving snapshot)
    holds never changes, even after a crop; a window that outgrows its buffer moves into a
    larger one, and ``memory()`` reports the buffer's room apart from the tokens."""
    from lessmem.base.placement import WINDOW_GRAIN

    torch.manual_seed(0)
    model = tiny_random("llama")
    cache = KVCache(model.config, resolve("best-4:window=16"))
    ids = torch.randint(1, model.config.vocab_size, (1, 40))
    with torch.inference_mode(), enable(model):
        model(ids[:, :18], cache=cache, use_cache=True)  # 4 sinks, 14 tokens in the window
        layer = cache.layers[0]
        assert layer.window_held()[0].shape[2] == WINDOW_GRAIN
        room = cache.memory()["window_room"]
        assert room == len(cache.layers) * 2 * 2 * layer.window[0][0, :, :1].numel() * layer.window[0].element_size()
        held = [t.clone() for t in layer.window]
        before = layer.window  # what a snapshot keeps
        model(ids[:, 18:19], cache=cache, use_cache=True)
        assert layer.window[0].data_ptr() == before[0].data_ptr()  # the same buffer, one more token
        assert layer.window[0].shape[2] == before[0].shape[2] + 1
        assert all(torch.equal(a, b) for a, b in zip(before, held, strict=True))
        model(ids[:, 19:21], cache=cache, use_cache=True)  # 17 tokens: a larger buffer
        assert layer.window[0].data_ptr() != before[0].data_ptr()
        assert layer.window_held()[0].shape[2] == 2 * WINDOW_GRAIN
        assert all(torch.equal(a, b) for a, b in zip(before, held, strict=True))
        before = layer.window
        held = [t.clone() for t in layer.window]
        cache.crop(-3)  # shorter: the next write goes to a new buffer, the old prefix stays
        model(ids[:, 21:30], cache=cache, use_cache=True)
        assert all(torch.equal(a, b) for a, b in zip(before, held, strict=True))
        assert layer.window[0].data_ptr() != before[0].data_ptr()
    ref = KVCache(model.config, resolve("best-4:window=16"))
    with torch.inference_mode():  # the same tokens fed in one go hold the same window
        x = torch.cat([ids[:, :18], ids[:, 21:30]], 1)
        model(x, cache=ref, use_cache=True)
    assert torch.equal(ref.layers[0].window[0], layer.window[0])



def _layer_state(layer) -> list[torch.Tensor]:
    return [*layer.sinks, *layer.window, *(t for p in layer._pieces for t in p.values())]


@pytest.mark.parametrize("cpp", [True, False])
def test_rows_appended_together_equal_one_at_a_time(monkeypatch, cpp):
    """``append_rows`` (a serving step's decode rows: one token into each request's layer)
    leaves every layer as ``_append`` one row at a time does, bit for bit, step after step:
    tokens written into their buffer's room (one C++ call), and those that take a sink,
    outgrow their buffer or flush a block (``_append``); fp16, bf16 and fp32 windows; rows
    that do not lie contiguously in k (v a view of a wider tensor, as the step's fused
    projection hands it)."""
    import copy

    from lessmem.kvcache import codec
    from lessmem.kvcache.layer import append_rows

    if not cpp:
        monkeypatch.setattr(codec, "_affine_cpp", lambda: None)
    elif codec._affine_cpp() is None:
        pytest.skip("no C++ compiler")
    torch.manual_seed(0)
    config = tiny_random("llama").config
    specs = ["best-4:window=16", "int4:sinks=4:window=8", "int8:window=16:window_dtype=bf16",
             "int4:window=16:window_dtype=fp32", "best-4:window=16"]
    H, D = config.num_key_value_heads, config.head_dim
    layers = []
    for i, spec in enumerate(specs):
        cache = KVCache(config, resolve(spec))
        n = [1, 2, 37, 15, 64][i]  # sinks not yet full, a buffer about to fill, a block about to flush
        cache.update(torch.randn(1, H, n, D), torch.randn(1, H, n, D), 0)
        layers.append(cache.layers[0])
    ref = copy.deepcopy(layers)
    views = [layer.window for layer in layers]
    held = [[t.clone() for t in w] for w in views]
    R = len(layers)
    for _ in range(100):
        y = torch.randn(R, 1, 3 * H * D)
        k = y[..., :H * D].contiguous().view(R, H, 1, D)
        v = y[..., 2 * H * D:].view(R, H, 1, D)  # not contiguous: a view of the projection
        append_rows(layers, k, v)
        for b, layer in enumerate(ref):
            layer._append(k[b:b + 1], v[b:b + 1])
        for got, want in zip(layers, ref, strict=True):
            assert got.length == want.length and got.n_history == want.n_history
            assert all(torch.equal(a, b) and a.dtype == b.dtype
                       for a, b in zip(_layer_state(got), _layer_state(want), strict=True))
            assert got.window_held()[0].shape == want.window_held()[0].shape
    assert all(layer.n_history for layer in layers)  # every row flushed blocks on the way
    assert all(torch.equal(a, b) for w, h in zip(views, held, strict=True) for a, b in zip(w, h, strict=True))


def test_long_prefill_chunks_trim_the_heap_every_few_layers(monkeypatch):
    # between layers of a long prefill chunk the heap's free pages go back to the OS (the
    # chunk's peak RSS grew with depth); not for short chunks or decode rows (a trim is ~3 ms)
    import lessmem.kvcache.layer as layer_mod

    trims = []
    monkeypatch.setattr(layer_mod, "trim_heap", lambda: trims.append(1) or True)
    model = tiny_random("llama")
    every, n = layer_mod.TRIM_EVERY_LAYERS, layer_mod.TRIM_MIN_TOKENS
    cache = KVCache(model.config, resolve("best-4"))  # layer indices as a deep model has them
    layers = [QuantizedKVLayer(cache.kv_config, i) for i in (every - 2, every - 1, 2 * every - 1, 2 * every)]
    H, D = model.config.num_key_value_heads, model.config.head_dim
    for tokens, want in ((n, 2), (n - 1, 0), (1, 0)):
        trims.clear()
        for layer in layers:
            layer.update(torch.randn(1, H, tokens, D), torch.randn(1, H, tokens, D))
        assert len(trims) == want, tokens
    # the serving engine's paged layers never trim (its next step reuses the pages)
    from lessmem.serve.paged import PagedKVLayer, PagePool

    trims.clear()
    for i in (every - 1, 2 * every - 1):
        PagedKVLayer(cache.kv_config, i, (None, None), lambda: False, PagePool()).update(
            torch.randn(1, H, n, D), torch.randn(1, H, n, D))
    assert not trims


def test_long_prompt_chunks_over_plain_tensors_trim_the_heap_every_few_layers(monkeypatch):
    # a DynamicCache's layers are transformers': in a switched model (lessmem.load's lean
    # decode) the attention trims for them (a chunk's freed pages stay otherwise,
    # base.cpu.tune_heap); a lessmem cache's fused views trim in their own update, not here,
    # and other plain tensors (the serving engine's full-precision pages) never trim
    from transformers import DynamicCache

    import lessmem
    import lessmem.kvcache.layer as layer_mod
    from lessmem.decode import lean_disable

    trims = []
    monkeypatch.setattr(layer_mod, "trim_heap", lambda: trims.append(1) or True)
    every, n = layer_mod.TRIM_EVERY_LAYERS, layer_mod.TRIM_MIN_TOKENS
    model = tiny_random("llama", num_layers=2 * every + 1)

    def prefill(tokens, cache) -> int:
        trims.clear()
        with torch.inference_mode(), enable(model):
            model(torch.randint(0, 200, (1, tokens)), past_key_values=cache, use_cache=True)
        return len(trims)

    assert prefill(n, DynamicCache()) == 0  # not switched: plain tensors of unknown origin
    lessmem.lean_decode(model)
    try:
        assert prefill(n, DynamicCache()) == 2
        assert prefill(n - 1, DynamicCache()) == 0
        assert prefill(n, KVCache(model.config, resolve("best-4"))) == 2  # the layers' own, none added
    finally:
        lean_disable(model)
