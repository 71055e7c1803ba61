"""The tiered KV cache (``lessmem.kvcache.tiered``) end to end: bit-exact with the in-memory
cache, within its device budget, across restarts, processes and tiers."""

import subprocess
import sys
import threading
from pathlib import Path

import _gen
import pytest
import torch

from lessmem.kvcache import KVCache, enable
from lessmem.kvcache.tiered import BlockLostError, TieredKVCache
from lessmem.offload import DiskTier, HostTier, RedisTier

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)  # 2 shared cores: OpenMP spinning across busy processes makes tiny ops 100x slower


def reference(m, ids, steps):
    cache = KVCache(m.config, _gen.CFG)
    return _gen.decode(m, cache, _gen.chunked_prefill(m, cache, ids), steps)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prefetch,policy", [("gather", "write-back"), ("hint", "write-through"),
                                             (False, "write-back")])
def test_bit_exact_with_in_memory_cache(tmp_path, fused, prefetch, policy):
    m = _gen.model()
    switch = enable(m) if fused else None
    try:
        ids = _gen.prompt()
        ref_toks, ref_logits = reference(m, ids, 40)
        cache = TieredKVCache(m.config, _gen.CFG, tiers=f"host@6KiB,disk:{tmp_path}", block_tokens=32,
                              device_budget="24KiB", prefetch=prefetch, write_policy=policy)
        toks, logits = _gen.decode(m, cache, _gen.chunked_prefill(m, cache, ids), 40)
        assert toks == ref_toks
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
        place = cache.memory()["tiers"]
        assert place["host"] > 0 and place["disk"] > 0  # the history really was spread out
        mem = cache.memory()
        assert mem["tokens"] == 150 + 40 and mem["codes"] > 0
        p = cache.offload_stats()["prefetch"]
        assert cache.prefetch == (prefetch or None)
        if prefetch:
            assert p["issued"] > 0 and p["on_time"] + p["late"] > 0
            if prefetch == "hint":  # once a step, not once a layer
                assert p["issued"] <= 40 + 150 // 16 + 2
        else:
            assert p["issued"] == 0
        cache.close()
    finally:
        if switch is not None:
            switch.disable()


@pytest.mark.parametrize("prefetch", ["gather", "hint"])
def test_device_budget_is_never_exceeded(tmp_path, prefetch):
    from lessmem.models import tiny_random

    # many thin layers: the gathered histories in flight (2 layers) are a small share
    m = tiny_random("llama", num_layers=24, hidden_size=32, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, seed=2)
    enable(m)
    cfg = _gen.CFG.replace(window=8, block_size=8)
    ids = _gen.prompt(420)
    ref = KVCache(m.config, cfg)
    ref_toks, _ = _gen.decode(m, ref, _gen.chunked_prefill(m, ref, ids, chunk=16), 12)
    budget = ref.memory()["total"] // 4  # 25% of the in-memory quantized cache
    cache = TieredKVCache(m.config, cfg, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=16,
                          device_budget=budget, prefetch=prefetch)
    seen = []

    def check():
        seen.append(cache.device_bytes())
        assert cache.device_bytes() <= budget

    logits = _gen.chunked_prefill(m, cache, ids, chunk=16)
    tight = cache.over_budget  # prefill chunks of 16 tokens may leave no room for the device tier
    toks, _ = _gen.decode(m, cache, logits, 12, check=check)
    assert toks == ref_toks
    assert cache.device_peak <= budget and cache.over_budget == tight and len(seen) == 12
    for layer in cache.layers:  # the budget counts the window's buffer as held (WINDOW_GRAIN), not its tokens
        held = [*layer.sinks, *layer.window_held()]
        assert layer.fp_bytes() == sum(t.untyped_storage().nbytes() for t in held) + layer.pending_bytes()
    mem = cache.memory()
    assert mem["tiers"]["device"] < budget and mem["tiers"]["disk"] > 0.5 * mem["total"]
    cache.close()


def test_prefetch_auto_gathers_only_with_a_free_core_or_a_remote_tier(tmp_path, monkeypatch):
    import os

    m = _gen.model()
    cache = TieredKVCache(m.config, _gen.CFG, tiers=f"disk:{tmp_path}")
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads)), raising=False)
        assert cache.prefetch == "hint"  # every core computes: only the page-cache hint
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads + 1)), raising=False)
        assert cache.prefetch == "gather"
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads)), raising=False)
        cache.lower[0].kind = "remote"  # waiting on a network costs no core: always gather
        assert cache.prefetch == "gather"
    finally:
        cache.close()
    assert TieredKVCache(m.config, _gen.CFG, prefetch=False).prefetch is None
    assert TieredKVCache(m.config, _gen.CFG, prefetch="hint").prefetch == "hint"
    with pytest.raises(ValueError, match="prefetch='always'; allowed"):
        TieredKVCache(m.config, _gen.CFG, prefetch="always")


def _first_process(spec, out):
    subprocess.run([sys.executable, str(HERE / "_restart.py"), spec, str(out)], check=True)
    return torch.load(out, weights_only=False)


def test_restart_skips_prefill_and_gives_equal_logits(tmp_path):
    spec = f"host,disk:{tmp_path / 'store'}"
    a = _first_process(spec, tmp_path / "first.pt")  # generate, then that process exits
    assert a["skipped"] == 0 and a["prefill_calls"] > 0
    b = _gen.run_saved_prompt(spec)  # reopen the disk store in this process
    assert b["skipped"] == 1 and b["prefill_calls"] == 0  # no forward pass for the prompt
    assert b["toks"] == a["toks"] and torch.equal(b["logits"], a["logits"])
    assert b["stats"]["disk"]["hits"] >= b["blocks"] // 2


def test_shared_prefix_through_redis(tmp_path, redis_server):
    spec = f"host,{redis_server.url}"
    a = _first_process(spec, tmp_path / "a.pt")
    b = _gen.run_saved_prompt(spec)
    assert b["skipped"] == 1 and b["prefill_calls"] == 0
    assert b["toks"] == a["toks"] and torch.equal(b["logits"], a["logits"])
    # the prompt's blocks (4 per layer) and the state record came from the other process
    assert b["stats"]["remote"]["hits"] >= 4 * b["layers"] + 1


def test_redis_down_keeps_working(tmp_path, dead_redis_url):
    m = _gen.model()
    ids = _gen.prompt()
    ref_toks, ref_logits = reference(m, ids, 10)
    with pytest.warns(RuntimeWarning, match="unavailable"):
        cache = TieredKVCache(m.config, _gen.CFG, tiers=[HostTier(None), RedisTier(dead_redis_url)],
                              block_tokens=32, device_budget="8KiB", write_policy="write-through")
        toks, logits = _gen.decode(m, cache, _gen.chunked_prefill(m, cache, ids), 10)
    assert toks == ref_toks and all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert cache.offload_stats()["remote"]["errors"] >= 1


def test_threads_share_one_disk_store(tmp_path):
    m = _gen.model()
    prompts = [_gen.prompt(120, seed=s % 2) for s in range(4)]  # two pairs share a prompt
    serial = [reference(m, p, 12)[0] for p in prompts]
    shared = DiskTier(tmp_path)
    results, errors = {}, []

    def work(i):
        try:
            cache = TieredKVCache(m.config, _gen.CFG, tiers=[shared if i % 2 else DiskTier(tmp_path)],
                                  block_tokens=32, device_budget="12KiB")
            cache.set_tokens(prompts[i])
            results[i] = _gen.decode(m, cache, _gen.chunked_prefill(m, cache, prompts[i]), 12)[0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert not errors and [results[i] for i in range(4)] == serial
    fresh = DiskTier(tmp_path)
    assert all(fresh.get(k) is not None for k in fresh.keys()) and fresh.stats.corrupt == 0


def test_corrupted_offloaded_block_is_an_error_not_data(tmp_path):
    m = _gen.model()
    cache = TieredKVCache(m.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32,
                          device_budget="16KiB", prefetch=False)
    logits = _gen.chunked_prefill(m, cache, _gen.prompt())
    victim = cache.tiered[0].block_keys[0]
    assert cache.stack.where(victim) == "disk"
    f = tmp_path / "blocks" / f"{victim}.blk"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(data)
    with pytest.warns(RuntimeWarning, match="corrupt"), pytest.raises(BlockLostError, match=victim):
        _gen.decode(m, cache, logits, 1)


def test_bad_arguments(tmp_path):
    m = _gen.model()
    with pytest.raises(ValueError, match="block_tokens=24"):
        TieredKVCache(m.config, _gen.CFG, block_tokens=24)
    with pytest.raises(ValueError, match="device tier is implicit"):
        TieredKVCache(m.config, _gen.CFG, tiers="device,host")
    with pytest.raises(ValueError, match="size"):
        TieredKVCache(m.config, _gen.CFG, device_budget="lots")
    cache = TieredKVCache(m.config, _gen.CFG, tiers="host", block_tokens=32)
    _gen.chunked_prefill(m, cache, _gen.prompt(40))
    with pytest.raises(ValueError, match="the cache holds 40 tokens"):
        cache.save_prefix(list(range(10)))
    with pytest.raises(ValueError, match="needs an empty cache"):
        cache.restore_prefix(list(range(40)))
    with pytest.raises(ValueError, match="batch 1"):
        cache.set_tokens(torch.zeros(2, 5, dtype=torch.long))
    assert TieredKVCache(m.config, _gen.CFG, tiers="host").restore_prefix([1, 2, 3]) is None


def test_from_cache_continues_bit_exact(tmp_path):
    m = _gen.model()
    enable(m)
    ids = _gen.prompt()
    src = KVCache(m.config, _gen.CFG)
    logits = _gen.chunked_prefill(m, src, ids)
    tiered = TieredKVCache.from_cache(src, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32,
                                      device_budget="12KiB")
    assert tiered.memory()["total"] == src.memory()["total"] and tiered.memory()["tiers"]["disk"] > 0
    a = _gen.decode(m, src, logits, 12)
    b = _gen.decode(m, tiered, logits, 12)
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_to_kvcache_and_set_budget(tmp_path):
    m = _gen.model()
    ids = _gen.prompt()
    src = KVCache(m.config, _gen.CFG)
    logits = _gen.chunked_prefill(m, src, ids)
    tiered = TieredKVCache.from_cache(src, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32)
    assert tiered.memory()["tiers"]["disk"] == 0
    tiered.set_device_budget(tiered.fp_bytes() + 4096)
    assert tiered.memory()["tiers"]["disk"] > 0
    back = tiered.to_kvcache()
    assert back.memory()["total"] == src.memory()["total"]
    a, b = _gen.decode(m, src, logits, 6), _gen.decode(m, back, logits, 6)
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_save_prefix_rekeys_session_blocks(tmp_path):
    m = _gen.model()
    ids = _gen.prompt(100)
    # model=: a cache that knows only a config shares nothing (save_prefix refuses)
    cache = TieredKVCache(m.config, _gen.CFG, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32, model=m)
    logits = _gen.chunked_prefill(m, cache, ids)  # no set_tokens: blocks get session keys
    session = "s" + cache.session
    assert all(k.startswith(session) for la in cache.tiered for k in la.block_keys)
    cache.save_prefix(ids[0], logits)
    keys = [k for la in cache.tiered for k in la.block_keys]
    assert keys and not any(k.startswith(session) for k in keys)
    held = DiskTier(tmp_path).keys() + cache.device_tier.keys()
    assert not any(k.startswith(session) for k in held) and sum(k.startswith("state-") for k in held) == 1
    fresh = TieredKVCache(m.config, _gen.CFG, tiers=[DiskTier(tmp_path)], block_tokens=32, model=m)
    assert torch.equal(fresh.restore_prefix(ids[0]), logits)
    a = _gen.decode(m, cache, logits, 4)
    b = _gen.decode(m, fresh, logits, 4)
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("fused", [True, False])
def test_sliding_window_policy(tmp_path, fused):
    m = _gen.model()
    switch = enable(m) if fused else None
    try:
        cfg = _gen.CFG.replace(sinks=0)
        ids = _gen.prompt(200)
        # a window covering everything is the plain cache, bit for bit
        ref = KVCache(m.config, cfg)
        ref_out = _gen.decode(m, ref, _gen.chunked_prefill(m, ref, ids), 6)
        wide = TieredKVCache(m.config, cfg, tiers="host", block_tokens=32, attention_window=1024)
        out = _gen.decode(m, wide, _gen.chunked_prefill(m, wide, ids), 6)
        assert out[0] == ref_out[0] and all(torch.equal(a, b) for a, b in zip(out[1], ref_out[1], strict=True))
        # a narrow window attends to the last 2 blocks + the window; older blocks stay on disk
        def narrow(budget):
            c = TieredKVCache(m.config, cfg, tiers=[DiskTier(tmp_path / str(budget), fsync=False)],
                              block_tokens=32, attention_window=64, device_budget=budget)
            return c, _gen.decode(m, c, _gen.chunked_prefill(m, c, ids), 6)

        small, a = narrow(20000)
        big, b = narrow(None)
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
        assert not all(torch.equal(x, y) for x, y in zip(a[1], ref_out[1], strict=True))
        la = small.tiered[0]
        assert la.hidden_blocks() == len(la.block_keys) - 2 > 0
        assert all(small.stack.where(k) is not None for k in la.block_keys)  # kept for reuse
        hits = small.offload_stats()["disk"]["hits"]
        _gen.decode(m, small, a[1][-1], 2)  # decoding never reads the hidden blocks
        assert small.offload_stats()["disk"]["hits"] - hits <= 2 * 2 * len(small.tiered)
    finally:
        if switch is not None:
            switch.disable()
    with pytest.raises(ValueError, match="sinks=0"):
        TieredKVCache(m.config, _gen.CFG, block_tokens=32, attention_window=64)
    with pytest.raises(ValueError, match="attention_window=48"):
        TieredKVCache(m.config, cfg, block_tokens=32, attention_window=48)


@pytest.mark.parametrize("sinks", [4, 0])
def test_prompt_sharing_only_a_prefix_reuses_its_blocks(tmp_path, sinks):
    # another request (here: a later cache on the same store) with the same first 120
    # tokens and a different tail loads the stored blocks of that prefix, computes the rest
    cfg = _gen.CFG.replace(sinks=sinks)
    m = _gen.model()
    fed = []
    m.register_forward_pre_hook(lambda mod, args: fed.append(args[0].shape[1]))
    p1 = _gen.prompt(150)
    p2 = torch.cat([p1[:, :120], _gen.prompt(40, seed=5)], dim=1)
    spec = f"host,disk:{tmp_path / 'store'}"
    a = TieredKVCache(m.config, cfg, tiers=spec, block_tokens=32, model_id="tiny")
    a.prefill(m, p1)
    a.close()
    fed.clear()
    b = TieredKVCache(m.config, cfg, tiers=spec, block_tokens=32, model_id="tiny")
    got = b.prefill(m, p2)
    reused = sinks + 32 * ((120 - sinks) // 32)  # whole blocks inside the shared prefix
    assert b.prefix_tokens_reused == reused and b.offload_stats()["prefix_tokens_reused"] == reused
    assert sum(fed) == 160 - reused and b.prefill_skipped == 0
    assert b.get_seq_length() == 160
    full = TieredKVCache(m.config, cfg, tiers=f"disk:{tmp_path / 'other'}", block_tokens=32, model_id="tiny")
    want = full.prefill(m, p2)
    # not bit-exact (the tail attended to a fully quantized prefix), but the same prediction
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # decoding continues from the restored state like from a computed one
    toks_b, _ = _gen.decode(m, b, got, 4)
    toks_f, _ = _gen.decode(m, full, want, 4)
    assert toks_b == toks_f
    # an unrelated prompt reuses nothing
    c = TieredKVCache(m.config, cfg, tiers=spec, block_tokens=32, model_id="tiny")
    c.prefill(m, _gen.prompt(100, seed=9))
    assert c.prefix_tokens_reused == 0
    for x in (b, full, c):
        x.close()


def test_prompt_state_goes_to_the_tiers_that_can_hold_it(tmp_path):
    # a small host tier cannot take the state record: it is stored on disk, and a later
    # cache over that disk restores the prompt
    m = _gen.model()
    ids = _gen.prompt(150)
    a = TieredKVCache(m.config, _gen.CFG, tiers=f"host@4KiB,disk:{tmp_path}", block_tokens=32, model_id="tiny")
    logits = a.prefill(m, ids)
    key = a.prefixes.state_key(ids[0].tolist())
    assert not a.lower[0].contains(key) and a.lower[1].contains(key) and a.lower[0].nbytes <= 4096
    a.close()
    b = TieredKVCache(m.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32, model_id="tiny")
    assert torch.equal(b.restore_prefix(ids[0]), logits) and b.prefill_skipped == 1
    b.close()


