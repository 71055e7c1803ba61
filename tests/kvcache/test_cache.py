"""KVCache against DynamicCache, fused vs reference attention, generate(), batch ops."""

from __future__ import annotations

import pytest
import torch
from kvhelpers import left_padded_ids, run_chunks, tiny
from transformers import DynamicCache

import lessmem
from lessmem.kvcache import PRESETS, KVCache, KVConfig, enable
from lessmem.kvcache.cache import cache_kwarg

QUANTIZED = [p for p in PRESETS if p != "fp16"]
CHUNKS = [100, 1, 1, 33, 7, 40, 1, 5, 1]  # prefill, single tokens, chunks; rest in one piece


def generate(model, ids, cache, **kw):
    """model.generate with ``cache`` under the keyword the installed transformers takes."""
    return model.generate(ids, **{cache_kwarg(model): cache}, **kw)


@pytest.mark.parametrize("arch,sliding", [("llama", None), ("qwen2", 48), ("mistral", 48)])
def test_fp16_preset_equals_dynamic_cache(arch, sliding):
    model = tiny(arch, sliding)
    ids, mask = left_padded_ids(2, 230, [0, 23])
    ref = run_chunks(model, ids, DynamicCache(config=model.config), CHUNKS, mask)
    for fused in (False, True):
        cache = KVCache(model.config, "fp16")
        if fused:
            with enable(model):
                got = run_chunks(model, ids, cache, CHUNKS, mask)
        else:
            got = run_chunks(model, ids, cache, CHUNKS, mask)
        valid = mask.bool()
        torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=1e-5)
        assert cache.get_seq_length() == 230


@pytest.mark.parametrize("preset", QUANTIZED)
def test_fused_equals_reference_path(llama, preset):
    ids, mask = left_padded_ids(2, 260, [0, 37], seed=1)
    ref = run_chunks(llama, ids, KVCache(llama.config, preset, attention="reference"), CHUNKS, mask)
    with enable(llama):
        cache = KVCache(llama.config, preset)
        got = run_chunks(llama, ids, cache, CHUNKS, mask)
    valid = mask.bool()
    # float32 throughout: the two paths differ only in summation order
    torch.testing.assert_close(got[valid], ref[valid], atol=2e-4, rtol=1e-4)
    assert cache.memory()["codes"] > 0


@pytest.mark.parametrize("arch,sliding,mode", [("qwen2", 40, "exact"), ("qwen2", 40, "quantize"),
                                               ("mistral", 40, "quantize")])
def test_sliding_window_models(arch, sliding, mode):
    model = tiny(arch, sliding)
    cfg = PRESETS["kivi-4"].replace(sliding=mode)
    ids, mask = left_padded_ids(2, 230, [0, 11], seed=2)
    ref = run_chunks(model, ids, KVCache(model.config, cfg, attention="reference"), CHUNKS, mask)
    with enable(model):
        got = run_chunks(model, ids, KVCache(model.config, cfg), CHUNKS, mask)
    dyn = run_chunks(model, ids, DynamicCache(config=model.config), CHUNKS, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=2e-4, rtol=1e-4)
    # quantization moves the logits, but only a little on a 4-bit cache
    assert (got[valid] - dyn[valid]).abs().mean() < 0.05 * dyn[valid].abs().mean()


def test_quantized_caches_stay_close_to_dynamic(llama):
    ids, mask = left_padded_ids(1, 300, [0], seed=3)
    dyn = run_chunks(llama, ids, DynamicCache(), CHUNKS, mask)
    errs = {}
    with enable(llama):
        for preset in ("int8", "fp8", "best-4", "kivi-2"):
            got = run_chunks(llama, ids, KVCache(llama.config, preset), CHUNKS, mask)
            errs[preset] = ((got - dyn).pow(2).mean() / dyn.pow(2).mean()).item()
    assert errs["int8"] < 1e-4
    assert errs["int8"] < errs["best-4"] < errs["kivi-2"] < 0.5
    assert errs["fp8"] < errs["best-4"]


def test_generate_greedy_fp16_equals_dynamic_and_quantized_runs(llama):
    ids, mask = left_padded_ids(2, 40, [0, 5], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = llama.generate(ids, **kw)
    got = generate(llama, ids, KVCache(llama.config, "fp16"), **kw)
    assert torch.equal(got, ref)
    small = PRESETS["kivi-4"].replace(window=8)
    with enable(llama):
        cache = KVCache(llama.config, small)
        q = generate(llama, ids, cache, **kw)
        sampled = generate(llama, ids, KVCache(llama.config, "kivi-2"), attention_mask=mask,
                           max_new_tokens=6, do_sample=True, top_k=5, pad_token_id=0)
    assert q.shape == ref.shape and sampled.shape == (2, 46)
    assert cache.get_seq_length() == 51 and cache.memory()["codes"] > 0


def test_beam_search(llama):
    ids, mask = left_padded_ids(2, 30, [0, 4], seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    ref = llama.generate(ids, **kw)
    got = generate(llama, ids, KVCache(llama.config, "fp16"), **kw)
    assert torch.equal(got, ref)
    cfg = PRESETS["kivi-4"].replace(window=4, block_size=32)
    with enable(llama):
        out = generate(llama, ids, KVCache(llama.config, cfg), **kw)
    assert out.shape == ref.shape


def test_reorder_and_select_move_every_part(llama):
    ids, _ = left_padded_ids(3, 200, [0, 0, 0], seed=6)
    cfg = PRESETS["int4"].replace(window=16)
    a = KVCache(llama.config, cfg)
    run_chunks(llama, ids, a, [200])
    b = KVCache(llama.config, cfg)
    run_chunks(llama, ids[[2, 0]], b, [200])
    a.reorder_cache(torch.tensor([2, 0, 1]))
    a.batch_select_indices(torch.tensor([0, 1]))
    la, lb = a.layers[1], b.layers[1]
    for name in la.history:
        assert torch.equal(la.history[name], lb.history[name])
    assert torch.equal(la.window[0], lb.window[0]) and torch.equal(la.sinks[1], lb.sinks[1])


def test_crop_within_window_and_refuses_history(llama):
    ids, _ = left_padded_ids(1, 100, [0], seed=7)
    cache = KVCache(llama.config, PRESETS["int4"].replace(window=16))
    run_chunks(llama, ids, cache, [100])
    n_win = cache.layers[0].window[0].shape[2]
    cache.crop(-3)
    assert cache.get_seq_length() == 97 and cache.layers[0].window[0].shape[2] == n_win - 3
    with pytest.raises(ValueError, match="allowed: crop sizes up to the window length"):
        cache.crop(-50)


def test_top_level_and_bad_arguments(llama):
    assert lessmem.KVCache is KVCache and lessmem.KVConfig is KVConfig
    with pytest.raises(ValueError, match="unknown KV preset 'int5'; allowed: .*kivi-2"):
        KVCache(llama.config, "int5")
    with pytest.raises(ValueError, match="attention='flash'; allowed: auto, fused, reference"):
        KVCache(llama.config, "int4", attention="flash")


def test_enable_is_reversible_and_falls_back_to_sdpa(llama):
    ids = torch.randint(3, 200, (1, 20))
    with torch.no_grad():
        ref = llama(ids).logits
        with enable(llama):
            assert llama.config._attn_implementation == "lessmem"
            got = llama(ids, **{cache_kwarg(llama): DynamicCache()}).logits  # plain tensors -> SDPA
    assert llama.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, ref)


def test_prefill_in_chunks_then_generate(llama):
    # KVCache.prefill feeds a prompt a chunk at a time: the same state as the chunks fed by
    # hand, the last position's logits, and generate continues from it (feeding only the
    # token the cache lacks), as after one forward with a DynamicCache up to rounding
    from lessmem.kvcache.cache import prefill_chunks

    ids = torch.randint(3, llama.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), enable(llama):
        cache = KVCache(llama.config, "int8")
        logits = cache.prefill(llama, ids[:, :-1], chunk=32)
        ref = KVCache(llama.config, "int8")
        for a in range(0, 89, 32):
            want = llama(ids[:, :-1][:, a:a + 32], **{cache_kwarg(llama): ref}, use_cache=True).logits[:, -1]
        assert cache.get_seq_length() == 89  # (one row through lm_head, not all: rounding)
        torch.testing.assert_close(logits, want.float(), atol=1e-5, rtol=1e-5)
        out = llama.generate(ids, **{cache_kwarg(llama): cache}, max_new_tokens=3, do_sample=False)
        again = llama.generate(ids, **{cache_kwarg(llama): ref}, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, again) and out.shape[1] == 93
        dyn = DynamicCache()
        last = prefill_chunks(llama, dyn, ids, chunk=7)
        whole = llama(ids, **{cache_kwarg(llama): DynamicCache()}, use_cache=True).logits[:, -1]
        torch.testing.assert_close(last, whole, atol=1e-5, rtol=1e-5)
    for bad, chunk, why in [(ids.float(), None, "input_ids"), (ids[0], None, "input_ids"), (ids[:, :0], None, "input_ids"),
                            (ids, 0, "chunk=0"), (ids, 2.5, "chunk=2.5"), (ids, True, "chunk=True")]:
        fresh = KVCache(llama.config, "int8")
        with pytest.raises(ValueError, match=why):
            fresh.prefill(llama, bad, chunk=chunk)
        assert fresh.get_seq_length() == 0  # refused before anything was fed
