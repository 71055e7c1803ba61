"""The parts of the tiered cache (``lessmem.kvcache.tiered``): the prefetcher, the shared device
budget, and what happens when no tier takes a block (nothing is lost, nothing is recorded
that was not stored)."""

import time
import warnings

import _gen
import pytest
import torch

from lessmem.kvcache import KVCache, enable
from lessmem.kvcache.tiered import DeviceBudget, Prefetcher, TieredKVCache
from lessmem.offload import DiskTier, HostTier, TierFullError, TierUnavailableError

torch.set_num_threads(1)


class Refusing(HostTier):
    """A lower tier that stores nothing while ``error`` is set (disk full, Redis down)."""

    def __init__(self, error=TierFullError, name="refusing"):
        super().__init__(None, name=name)
        self.error = error

    def put(self, key, block):
        if self.error is not None:
            raise self.error(f"{self.name} refuses {key!r}")
        super().put(key, block)


def test_prefetch_lateness_is_recorded():
    def slow(x):
        time.sleep(0.05)
        return x

    p = Prefetcher("gather", [])
    p.start(0, "t0", 100, slow, 1)
    assert p.in_flight_bytes() == 100
    assert p.take(0, "t0") == 1  # asked at once: late
    p.start(1, "t1", 50, slow, 2)
    time.sleep(0.2)
    assert p.take(1, "t1") == 2  # asked after it arrived: on time
    s = p.stats.to_dict()
    assert s["issued"] == 2 and s["late"] == 1 and s["on_time"] == 1 and s["late_seconds"] > 0.01
    p.start(2, "old", 10, slow, 3)
    assert p.take(2, "new") is None  # the layer changed since: stale, not used
    assert p.take(5, "t") is None and p.in_flight_bytes() == 0
    p.close()
    with pytest.raises(ValueError, match="prefetch='always'; allowed"):
        Prefetcher("always", [])


def test_auto_prefetch_gathers_on_a_gpu_and_staging_passes_device_blocks_through(monkeypatch):
    from lessmem.kvcache.tiered import prefetch as pf
    from lessmem.kvcache.tiered.staging import CudaStager

    monkeypatch.setattr(pf, "usable_cores", lambda: torch.get_num_threads())  # no spare core
    assert Prefetcher(True, []).mode == "hint"
    assert Prefetcher(True, [], "cpu").mode == "hint"
    assert Prefetcher(True, [], "cuda").mode == "gather"  # the copy engine moves, the thread issues
    assert Prefetcher(False, [], "cuda").mode is None
    # blocks already on the device: no stream, no event, the same tensors
    parts = [{"k_codes": torch.zeros(1, 2, 4, 8, dtype=torch.uint8)}]
    staged = CudaStager().stage(parts, torch.device("cpu"))
    got = staged.ready()
    assert got is parts and got[0]["k_codes"] is parts[0]["k_codes"]


def test_caches_sharing_one_budget_stay_within_it_together(tmp_path):
    m = _gen.model()
    enable(m)
    prompts = [_gen.prompt(150, seed=s) for s in (0, 1)]
    refs = []
    for ids in prompts:
        ref = KVCache(m.config, _gen.CFG)
        refs.append(_gen.decode(m, ref, _gen.chunked_prefill(m, ref, ids, chunk=8), 8))
    budget = DeviceBudget("72KiB")
    caches = [TieredKVCache(m.config, _gen.CFG, tiers=[DiskTier(tmp_path / str(i), fsync=False)],
                            block_tokens=32, device_budget=budget) for i in range(2)]
    assert len(budget.accounts) == 2 and all(c.device_budget == 72 * 1024 for c in caches)
    logits = [None, None]
    with torch.no_grad():  # the two requests' prefill chunks interleaved, as a batch server would
        for a in range(0, 150, 8):  # (short chunks: little room for the chunk's new tokens)
            for i, c in enumerate(caches):
                out = m(prompts[i][:, a:a + 8], **_gen.cache_kwargs(m, c), logits_to_keep=1)
                logits[i] = out.logits[:, -1].float()
    seen = []
    for i, c in enumerate(caches):
        toks, lg = _gen.decode(m, c, logits[i], 8,
                               check=lambda: seen.append(sum(x.device_bytes() for x in caches)))
        assert toks == refs[i][0] and all(torch.equal(x, y) for x, y in zip(lg, refs[i][1], strict=True))
    assert budget.over_budget == 0 and budget.peak <= 72 * 1024 and max(seen) <= 72 * 1024
    assert all(c.memory()["tiers"]["disk"] > 0 for c in caches)
    assert sum(c.memory()["tiers"]["device"] for c in caches) > 0
    for c in caches:
        c.close()
    assert budget.accounts == []
    dropped = TieredKVCache(m.config, _gen.CFG, tiers="host", block_tokens=32, device_budget=budget)
    assert len(budget.accounts) == 1
    del dropped  # never closed: a cache nobody holds stops counting against the others
    import gc

    gc.collect()
    assert budget.accounts == []


def test_a_budget_below_the_working_set_warns_once_and_counts():
    m = _gen.model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache = TieredKVCache(m.config, _gen.CFG, tiers="host", block_tokens=32, device_budget="4KiB")
        _gen.decode(m, cache, _gen.chunked_prefill(m, cache, _gen.prompt(150)), 4)
    over = [w for w in seen if "is below what the tiered KV cache must hold" in str(w.message)]
    assert len(over) == 1 and "device_budget=4096 bytes" in str(over[0].message)
    stats = cache.offload_stats()
    assert stats["over_budget"] > 10 and stats["needed_budget"] > 4096
    assert cache.device_peak > 4096  # over budget, as warned: the data is all there
    cache.close()


@pytest.mark.parametrize("error", [TierFullError, TierUnavailableError])
def test_a_block_no_tier_takes_is_not_recorded_and_its_tokens_stay(error):
    from lessmem.models import tiny_random

    model = tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1)
    cfg = _gen.CFG.replace(sinks=0)
    low = Refusing(error)
    cache = TieredKVCache(model.config, cfg, tiers=[low], block_tokens=32, device_budget=0,
                          attention="reference")
    plain = KVCache(model.config, cfg, attention="reference")
    la = cache.tiered[0]

    def feed(n):
        k = torch.randn(1, 1, n, 64)
        want, got = plain.update(k, k.clone(), 0), cache.update(k, k.clone(), 0)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))  # what attention reads

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        feed(100)
        feed(16)  # read with the waiting tokens, and another refused seal
    refused = [w for w in seen if "no tier can take KV block 's" in str(w.message)]
    assert len(refused) == 1 and f"{low.name}: {low.name} refuses" in str(refused[0].message)
    assert la.block_keys == [] and la.block_bytes == []  # nothing stored, nothing recorded
    assert cache.stack.placement() == {"device": 0, "refusing": 0}
    # every token is still there once: quantized, waiting on the device for a tier
    assert la.length == 116 and la.n_history == la.n_pending == 96 and la.window[0].shape[2] == 20
    assert cache.offload_stats()["refused_blocks"] == 2
    low.error = None  # the tier takes blocks again: the next quantized tokens seal all waiting
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (over budget: expected with budget 0)
        feed(16)
    assert len(la.block_keys) == 3 and la.n_pending == 16 and all(low.contains(k) for k in la.block_keys)
    back, want = cache.to_kvcache().layers[0], plain.layers[0]
    assert back.n_history == want.n_history == 112
    assert all(torch.equal(back.history[n], want.history[n]) for n in want.history)
    cache.close()


def test_save_prefix_succeeds_when_one_tier_holds_every_block(tmp_path):
    m = _gen.model()
    ids = _gen.prompt(150)
    host, full = HostTier(None), Refusing(TierFullError, name="disk")
    a = TieredKVCache(m.config, _gen.CFG, tiers=[host, full], block_tokens=32, model_id="tiny")
    logits = a.prefill(m, ids)  # the disk is full: the host holds every block and the record
    key = a.prefixes.state_key(ids[0].tolist())
    assert host.contains(key) and all(host.contains(k) for la in a.tiered for k in la.block_keys)
    b = TieredKVCache(m.config, _gen.CFG, tiers=[host, Refusing(TierFullError, name="disk")],
                      block_tokens=32, model_id="tiny")
    assert torch.equal(b.restore_prefix(ids[0]), logits) and b.prefill_skipped == 1


def test_a_prefill_no_tier_can_save_still_returns_its_logits():
    m = _gen.model()
    ids = _gen.prompt(150)
    ref = KVCache(m.config, _gen.CFG)
    want = _gen.chunked_prefill(m, ref, ids)
    cache = TieredKVCache(m.config, _gen.CFG, tiers=[Refusing(TierFullError, name="disk")], block_tokens=32)
    with pytest.warns(RuntimeWarning, match="the prompt's state was not saved"):
        got = cache.prefill(m, ids)
    assert torch.equal(got, want)
    toks, _ = _gen.decode(m, cache, got, 4)  # the blocks stay readable on the device
    assert toks == _gen.decode(m, ref, want, 4)[0]
    with pytest.raises(TierFullError, match="no tier can store"):
        cache.save_prefix(torch.cat([ids, torch.tensor([toks])], dim=1)[0])


def test_construction_checks_before_opening_tiers(tmp_path):
    m = _gen.model()
    for kwargs, match in [(dict(prefetch="always"), "prefetch='always'; allowed"),
                          (dict(attention="magic"), "attention='magic'; allowed"),
                          (dict(block_tokens=24), "block_tokens=24"),
                          (dict(device_budget="lots"), "device_budget='lots'")]:
        with pytest.raises(ValueError, match=match):
            TieredKVCache(m.config, _gen.CFG, tiers=f"disk:{tmp_path / 'never'}", **kwargs)
    with pytest.raises(TypeError, match="pass model.config"):
        TieredKVCache(m, _gen.CFG, tiers=f"disk:{tmp_path / 'never'}")
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="names the device tier; the device tier is implicit"):
        TieredKVCache(m.config, _gen.CFG, tiers="device,host")


def test_the_placement_policy_is_plain_arithmetic():
    from lessmem.base.placement import (
        blocks_kept,
        check_lower_tiers,
        device_need,
        device_room,
        staging_reserve,
    )

    assert staging_reserve(1000, prefetch=True) == 2000 and staging_reserve(1000, prefetch=False) == 1000
    need = device_need(resident=3000, growth=500, reserve=2000)
    assert need == 5500 and device_room(None, need) is None and blocks_kept(None, 100) is None
    assert device_room(5000, need) == -500 and blocks_kept(-500, 100) == 0  # over budget: keep none
    assert blocks_kept(device_room(8000, need), 1000) == 2
    check_lower_tiers([])  # nothing to say
    with pytest.raises(ValueError, match="offload names the device tier; the device tier is implicit "
                                         r"\(set its size with kv_budget\)"):
        from lessmem.offload import parse_offload_spec

        check_lower_tiers(parse_offload_spec("device,host"), what="offload", budget_name="kv_budget")
