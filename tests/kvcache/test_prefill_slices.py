"""Long prefill chunks over a quantized history: the history is dequantized a slice at a
time (``view.PREFILL_SLICE_TOKENS``), never whole, and the result equals the dequantized
reference path (in-memory and tiered caches, with and without rotation)."""

from __future__ import annotations

import pytest
import torch
from kvhelpers import tiny

from lessmem.kvcache import PRESETS, KVCache, enable, view
from lessmem.kvcache.cache import cache_kwarg
from lessmem.kvcache.tiered import TieredKVCache

CHUNKS = [130, 100, 300, 200, 1]  # the 3rd and 4th find a quantized history: sliced path (>= 64 queries)


def _run(model, cache, ids):
    out, s = [], 0
    with torch.no_grad():
        for n in CHUNKS:
            r = model(ids[:, s:s + n], **{cache_kwarg(model): cache}, use_cache=True)
            out.append(r.logits)
            s += n
    return torch.cat(out, dim=1)


@pytest.fixture
def slices(monkeypatch):
    """Small slices, and a count of the slices each sliced call read."""
    monkeypatch.setattr(view, "PREFILL_SLICE_TOKENS", 64)
    seen = []
    orig = view.LayerView._history_slices

    def counting(self):
        pieces = list(orig(self))
        seen.append([k.n_tokens for k, _ in pieces])
        assert sum(seen[-1]) == self.n_history  # every history token once, in order
        return iter(pieces)

    monkeypatch.setattr(view.LayerView, "_history_slices", counting)
    return seen


@pytest.mark.parametrize("preset", ["int4", "best-4", "best-3", "best-2", "kivi-2"])
def test_sliced_prefill_equals_reference(slices, preset):
    model = tiny("llama")
    ids = torch.randint(3, 250, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(4))
    ref = _run(model, KVCache(model.config, preset, attention="reference"), ids)
    with enable(model):
        got = _run(model, KVCache(model.config, preset), ids)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert slices and max(len(s) for s in slices) >= 3  # several slices per call, merged


def test_sliced_prefill_walks_tiered_parts(slices, tmp_path):
    model = tiny("llama")
    cfg = PRESETS["int4"].replace(window=16, block_size=16)
    ids = torch.randint(3, 250, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(5))
    ref = _run(model, KVCache(model.config, cfg, attention="reference"), ids)
    with enable(model):
        cache = TieredKVCache(model.config, cfg, tiers=f"host@64KiB,disk:{tmp_path}", block_tokens=32,
                              device_budget="48KiB")
        got = _run(model, cache, ids)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert any(len(s) > 1 and max(s) <= 32 for s in slices)  # the blocks, read in place


def test_small_parts_are_joined_up_to_a_slice_for_flash_attention(slices, tmp_path, monkeypatch):
    """A tiered (or paged) history arrives as blocks; consecutive blocks are dequantized and
    joined up to ``PREFILL_SLICE_TOKENS`` tokens, so flash attention and the log-sum-exp
    merge run once per slice, not once per block, and the result still equals the reference."""
    keys_per_call = []
    fp_attention = view._fp_attention

    def recording(q, k, v, mask, scaling, causal=False):
        if mask is None and not causal:  # a history slice (the full-precision parts are causal)
            keys_per_call.append(k.shape[2])
        return fp_attention(q, k, v, mask, scaling, causal)

    monkeypatch.setattr(view, "_fp_attention", recording)
    model = tiny("llama")
    cfg = PRESETS["int4"].replace(window=16, block_size=16)
    ids = torch.randint(3, 250, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(6))
    ref = _run(model, KVCache(model.config, cfg, attention="reference"), ids)
    with enable(model):
        got = _run(model, TieredKVCache(model.config, cfg, tiers=f"host@64KiB,disk:{tmp_path}",
                                        block_tokens=16, device_budget="48KiB"), ids)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert max(max(s) for s in slices) <= 16  # the blocks arrive one by one ...
    assert keys_per_call and max(keys_per_call) == 64  # ... and are attended 64 at a time (the slice)
    assert sum(keys_per_call) == sum(sum(s) for s in slices)  # every history token once


def test_plain_causal_mask_is_recognised():
    Tq, L = 5, 12
    m = torch.ones(2, 1, Tq, L, dtype=torch.bool)
    m[..., L - Tq:] = torch.ones(Tq, Tq, dtype=torch.bool).tril()
    assert view._is_plain_causal(m, Tq, L)
    padded = m.clone()
    padded[1, :, :, :2] = False  # left padding of row 1: the mask must be kept
    assert not view._is_plain_causal(padded, Tq, L)
    sliding = m.clone()
    sliding[..., -1, 0] = False  # a sliding window
    assert not view._is_plain_causal(sliding, Tq, L)
    assert not view._is_plain_causal(m.float(), Tq, L)  # additive masks are kept as they are
    assert not view._is_plain_causal(m, Tq, L + 1)
