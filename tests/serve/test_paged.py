"""A paged request cache's byte count: what the engine budgets with."""

from __future__ import annotations

import pytest
import torch

from lessmem.models import tiny_random
from lessmem.serve.paged import PagedKVCache, PagePool, release_snapshot


@pytest.mark.parametrize("kv", ["best-4", "fp16", "int4"])
def test_fp_bytes_count_every_full_precision_tensor_held(kv):
    """``fp_bytes`` (counted without listing the tensors) equals the storage bytes of ``fp_tensors``
    for layers before any token, inside the sinks, the window and after blocks have moved
    to pages; the cache's total is the layers' sum."""
    model = tiny_random("llama")
    cache = PagedKVCache(model.config, kv, PagePool())
    cfg, g = model.config, torch.Generator().manual_seed(0)
    heads = cfg.num_key_value_heads
    dim = cfg.hidden_size // cfg.num_attention_heads

    def check():  # the window is a view of a buffer with room to grow: the buffer is what is held
        for layer in cache.paged_layers():
            assert layer.fp_bytes() == sum(t.untyped_storage().nbytes() for t in layer.fp_tensors())
        assert cache.fp_bytes() == sum(layer.fp_bytes() for layer in cache.paged_layers())

    check()  # nothing held yet
    for n in (2, 1, 150, 1, 1, 70):  # sinks, a window, blocks moved to pages
        for i in range(cfg.num_hidden_layers - 1):  # the last layer stays empty
            k = torch.randn(1, heads, n, dim, generator=g)
            cache.update(k, k.clone(), i)
        check()
    assert cache.fp_bytes() > 0
    assert cache.paged_layers()[-1].fp_bytes() == 0
    if cache.paged_layers()[0].quantized:  # more than the window's tokens: its buffer's room
        layer = cache.paged_layers()[0]
        assert layer.fp_bytes() > sum(t.numel() * t.element_size() for t in layer.fp_tensors())
        state = layer.snapshot()  # a prefix snapshot copies the window out: it holds just the tokens
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state["window"])
        release_snapshot(cache.pool, [state])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_staged_history_is_kept_only_from_a_memory_tier(tier, tmp_path):
    """A layer keeps the history it read (and the kernel's table made for it) while its pages
    stay put; with a page staged from host RAM the same tensors come back every step, so the
    history is kept across steps; staged from disk it is a fresh copy, not kept, and no history
    kept from before holds the demoted page's tensors."""
    from lessmem.offload import DiskTier, HostTier

    model = tiny_random("llama")
    pool = PagePool()
    cache = PagedKVCache(model.config, "int4", pool)
    cfg, g = model.config, torch.Generator().manual_seed(0)
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    k = torch.randn(1, heads, 300, dim, generator=g)
    cache.update(k, k.clone(), 0)
    layer = cache.paged_layers()[0]
    assert layer.read_history() is layer.read_history()  # on the device: kept
    page = layer.pages[0]
    lower = HostTier(capacity=None) if tier == "host" else DiskTier(tmp_path / "kv")
    assert pool.demote(page, lower, "p0")
    seen = []
    for _ in range(2):  # two steps: stage, read, unstage
        assert pool.stage(page)
        seen.append(layer.read_history())
        assert (layer._hist is not None) == (tier == "host")
        page.staged = None
    assert (seen[0] is seen[1]) == (tier == "host")


def test_stage_all_stages_lower_tier_pages_and_stops_at_a_lost_one():
    """``PagePool.stage_all`` (the engine's per-request staging) reads every lower-tier page of
    a cache as ``stage`` does, leaves device pages alone, and answers False at the first page
    its tier no longer has."""
    from lessmem.offload import HostTier

    model = tiny_random("llama")
    pool = PagePool()
    cache = PagedKVCache(model.config, "int4", pool)
    cfg, g = model.config, torch.Generator().manual_seed(0)
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    for i in range(2):
        k = torch.randn(1, heads, 300, dim, generator=g)
        cache.update(k, k.clone(), i)
    pages = cache.pages()
    assert isinstance(pages, list) and len(pages) >= 4
    host = HostTier(capacity=None)
    parts = {}
    for i, page in enumerate(pages[1:]):
        parts[page.id] = dict(page.parts)
        assert pool.demote(page, host, f"p{i}")
    assert pool.stage_all(pages)
    assert pages[0].staged is None and pages[0].on_device
    for page in pages[1:]:
        assert all(torch.equal(page.staged[n], t) for n, t in parts[page.id].items())
        page.staged = None
    host.delete("p1")  # pages[2] is lost: staging stops there
    assert not pool.stage_all(pages)
    assert pages[1].staged is not None and pages[2].staged is None and pages[3].staged is None
