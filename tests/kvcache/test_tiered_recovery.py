"""A tiered cache that loses blocks recomputes them; stored state is keyed by the weights.

Faults (tiny random llama, int4, 32-token blocks): a real redis-server killed mid-decode
(alone and behind a small host tier), restarted empty, evicting under ``maxmemory`` with
``allkeys-lru``; a disk block deleted under the cache (a peer's eviction); block files
corrupted after a restore and before one. Each run completes, its tokens equal an
undisturbed run's and its logits are within the int4 cache's own tolerance of them
(recomputed tokens are new K/V of the same tokens), one BlockRecoveryWarning names the
tier, and ``offload_stats()`` counts the recovery.

Identity: a prefix saved by one model is not restored into another (other weights, the
same after ``quantize_``, another dtype), and the same weights share it across two
processes and two load paths.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import _gen
import pytest
import torch

from lessmem.kvcache import KVCache
from lessmem.kvcache.tiered import BlockLostError, BlockRecoveryWarning, TieredKVCache
from lessmem.offload import DiskTier

HERE = Path(__file__).resolve().parent
torch.set_num_threads(1)  # 2 shared cores
STEPS = 24
TOL = 0.05  # int4 cache vs. itself with some tokens recomputed in chunks (measured: < 0.01)


@pytest.fixture(scope="module")
def model():
    return _gen.model()


@pytest.fixture(scope="module")
def undisturbed(model):
    """Tokens and logits of an in-memory int4 cache over the same prompt and decode."""
    ref = KVCache(model.config, _gen.CFG)
    return _gen.decode(model, ref, _gen.chunked_prefill(model, ref, _gen.prompt()), STEPS)


def run_with_fault(model, cache, fault, at: int = 6):
    """Prefill + greedy decode, ``fault()`` after step ``at``; (tokens, logits, warnings)."""
    calls = {"n": 0}

    def check():
        calls["n"] += 1
        if calls["n"] == at:
            fault()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits = cache.prefill(model, _gen.prompt(), save=False)
        toks, all_logits = _gen.decode(model, cache, logits, STEPS, check=check)
    return toks, all_logits, seen


def assert_recovered(result, undisturbed, cache, tier: str):
    toks, logits, seen = result
    ref_toks, ref_logits = undisturbed
    assert toks == ref_toks
    worst = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True))
    assert worst < TOL, worst
    recov = [w for w in seen if issubclass(w.category, BlockRecoveryWarning)]
    assert len(recov) == 1, [str(w.message) for w in recov]
    assert f"the {tier} tier" in str(recov[0].message)
    stats = cache.offload_stats()
    assert stats["recoveries"] >= 1 and stats["tokens_recomputed"] > 0
    return stats


def _blocks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").glob("*.blk") if not p.name.startswith(("state-", "sinks-")))


# ---- faults during a run ---------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["{url}", "host@4KiB,{url}"])
def test_redis_killed_mid_decode(model, undisturbed, redis_proc, spec):
    redis_proc.start()
    cache = TieredKVCache(model.config, _gen.CFG, tiers=spec.format(url=redis_proc.url), block_tokens=32,
                          device_budget="16KiB", model=model)
    stats = assert_recovered(run_with_fault(model, cache, redis_proc.kill), undisturbed, cache, "remote")
    assert stats["remote"]["errors"] > 0
    cache.close()


def test_redis_down_from_the_start(model, undisturbed, redis_proc):
    cache = TieredKVCache(model.config, _gen.CFG, tiers=redis_proc.url, block_tokens=32,
                          device_budget="16KiB", model=model)  # never started: every put refused
    toks, logits, seen = run_with_fault(model, cache, lambda: None)
    assert toks == undisturbed[0]  # nothing was ever stored below: the tokens stayed on the device
    assert cache.offload_stats()["refused_blocks"] > 0
    cache.close()


def test_redis_restarted_empty(model, undisturbed, redis_proc):
    redis_proc.start()
    cache = TieredKVCache(model.config, _gen.CFG, tiers=redis_proc.url, block_tokens=32,
                          device_budget="16KiB", model=model)

    def restart():
        redis_proc.kill()
        redis_proc.start()

    assert_recovered(run_with_fault(model, cache, restart), undisturbed, cache, "remote")
    cache.close()


def test_redis_evicting_under_maxmemory(model, undisturbed, redis_proc):
    import redis

    redis_proc.start("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    cache = TieredKVCache(model.config, _gen.CFG, tiers=redis_proc.url, block_tokens=32,
                          device_budget="16KiB", model=model)

    def another_tenant_fills_the_server():
        client = redis.Redis.from_url(redis_proc.url)
        for i in range(80):  # 8 MB of newer values through a 4 MB server: the oldest keys go
            client.set(f"junk:{i}", b"x" * 100_000)
        client.close()

    assert_recovered(run_with_fault(model, cache, another_tenant_fills_the_server), undisturbed, cache, "remote")
    cache.close()


@pytest.mark.parametrize("prefetch,which", [("gather", "half"), (False, "half"), (False, "L02")])
def test_disk_block_deleted_by_a_peer(model, undisturbed, tmp_path, prefetch, which):
    # "L02": only layer 2 loses blocks, so the loss is found mid-forward, after layers 0
    # and 1 appended this step's tokens (put back after the recompute)
    cache = TieredKVCache(model.config, _gen.CFG, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32,
                          device_budget="16KiB", prefetch=prefetch, model=model)

    def peer_evicts():
        victims = _blocks(tmp_path)
        victims = victims[::2] if which == "half" else [p for p in victims if p.stem.endswith("-L02")]
        assert victims
        for p in victims:
            p.unlink()

    assert_recovered(run_with_fault(model, cache, peer_evicts), undisturbed, cache, "disk")
    cache.close()


def test_corrupt_block_after_a_restore_is_recomputed(model, undisturbed, tmp_path):
    ids = _gen.prompt()
    a = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32, model=model)
    saved = a.prefill(model, ids)
    a.close()
    b = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32,
                      device_budget="16KiB", prefetch=False, model=model)
    assert torch.equal(b.restore_prefix(ids[0]), saved)

    def corrupt():
        for p in _blocks(tmp_path):
            data = bytearray(p.read_bytes())
            data[-3] ^= 0x10
            p.write_bytes(data)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        corrupt()
        toks, logits = _gen.decode(model, b, saved, STEPS)
    assert_recovered((toks, logits, seen), undisturbed, b, "disk")
    assert b.offload_stats()["disk"]["corrupt"] > 0
    b.close()


def test_corrupt_blocks_before_a_restore_stop_it_there(model, undisturbed, tmp_path):
    ids = _gen.prompt()
    a = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32, model=model)
    a.prefill(model, ids)
    a.close()
    layer0 = sorted(p for p in _blocks(tmp_path) if p.stem.endswith("-L00"))
    victim = layer0[len(layer0) // 2]  # one block in the middle of layer 0's history
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    b = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32, model=model)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        logits = b.prefill(model, ids, save=False)
    assert b.prefill_skipped == 0  # the saved state was not used as it was
    assert 0 < b.prefix_tokens_reused < ids.shape[1]  # the blocks before the corrupt one were
    want = undisturbed[1][0]  # not bit-exact (the tail attended to a quantized prefix): as close
    print("restore stopped at a corrupt block: prefill logits off by", (logits - want).abs().max().item())
    assert torch.equal(logits.argmax(-1), want.argmax(-1)) and (logits - want).abs().max() < TOL
    b.close()


def test_without_the_model_a_loss_is_an_error_naming_the_tier_and_the_fix(model, tmp_path):
    cache = TieredKVCache(model.config, _gen.CFG, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32,
                          device_budget="16KiB", prefetch=False)
    logits = _gen.chunked_prefill(model, cache, _gen.prompt())
    for p in _blocks(tmp_path):
        p.unlink()
    with pytest.raises(BlockLostError, match=r"tiers: disk.*pass model= to TieredKVCache"):
        _gen.decode(model, cache, logits, 1)
    cache.close()


def test_unknown_token_ids_are_an_error_naming_the_fix(model, tmp_path):
    cache = TieredKVCache(model.config, _gen.CFG, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32,
                          device_budget="16KiB", prefetch=False, model=model)
    emb = model.get_input_embeddings()
    with torch.no_grad():  # fed as embeddings: the cache never sees the token ids
        out = model(inputs_embeds=emb(_gen.prompt()), **_gen.cache_kwargs(model, cache))
    for p in _blocks(tmp_path):
        p.unlink()
    with pytest.raises(BlockLostError, match="token ids of the lost tokens are unknown"):
        _gen.decode(model, cache, out.logits[:, -1].float(), 1)
    cache.close()


# ---- identity: whose state is restored -------------------------------------------------------

def _saved_by(model, root, ids):
    c = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{root}", block_tokens=32, model=model)
    logits = c.prefill(model, ids)
    c.close()
    return logits


def _prefill_fresh(model, root, ids):
    c = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{root}", block_tokens=32)
    logits = c.prefill(model, ids)
    out = (logits, c.prefill_skipped, c.prefix_tokens_reused)
    c.close()
    return out


def _other_models():
    from lessmem import RTNConfig, quantize_
    from lessmem.models import tiny_random

    def quantized():
        m = _gen.model()
        quantize_(m, RTNConfig(bits=4, group_size=32), progress=False)
        return m

    return {"other weights": lambda: tiny_random("llama", num_layers=4, seed=2),
            "quantized": quantized,
            "bf16": lambda: _gen.model().to(torch.bfloat16)}


@pytest.mark.parametrize("which", ["other weights", "quantized", "bf16"])
def test_a_prefix_of_one_model_is_not_restored_into_another(model, tmp_path, which):
    ids = _gen.prompt(100)
    _saved_by(model, tmp_path, ids)
    other = _other_models()[which]()
    logits, skipped, reused = _prefill_fresh(other, tmp_path, ids)
    assert skipped == 0 and reused == 0
    ref = KVCache(other.config, _gen.CFG)
    assert torch.equal(logits, _gen.chunked_prefill(other, ref, ids))


def test_same_weights_through_two_load_paths_share_a_prefix(model, tmp_path):
    from transformers import AutoModelForCausalLM

    ids = _gen.prompt(100)
    saved = _saved_by(model, tmp_path / "kv", ids)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert loaded.config._name_or_path != model.config._name_or_path
    logits, skipped, _ = _prefill_fresh(loaded, tmp_path / "kv", ids)
    assert skipped == 1 and torch.equal(logits, saved)


def test_same_weights_in_two_processes_share_a_prefix(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import torch, _gen; "
            "from lessmem.kvcache.tiered import TieredKVCache; torch.set_num_threads(1); "
            "m = _gen.model(); c = TieredKVCache(m.config, _gen.CFG, tiers=sys.argv[1], block_tokens=32); "
            "c.prefill(m, _gen.prompt(100)); print(c.prefill_skipped); c.close()")
    spec = f"disk:{tmp_path}"
    runs = [subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert [r.stdout.split()[-1] for r in runs] == ["0", "1"]


def test_a_cache_that_knows_only_a_config_shares_nothing(model, tmp_path):
    ids = _gen.prompt(100)
    _saved_by(model, tmp_path, ids)
    c = TieredKVCache(model.config, _gen.CFG, tiers=f"disk:{tmp_path}", block_tokens=32)
    assert c.model_id is None and c.restore_prefix(ids[0]) is None and c.restore_blocks(ids[0]) == 0
    logits = _gen.chunked_prefill(model, c, ids)
    assert all(k.startswith("s" + c.session) for la in c.tiered for k in la.block_keys)
    with pytest.raises(ValueError, match="save_prefix needs to know the model"):
        c.save_prefix(ids[0], logits)
    c.bind_model(model)  # now it can: its blocks are rekeyed to content keys on save
    c.save_prefix(ids[0], logits)
    c.close()


def test_model_argument_checks(model):
    from lessmem.models import tiny_random

    with pytest.raises(TypeError, match="model=dict"):
        TieredKVCache(model.config, _gen.CFG, model={})
    with pytest.raises(ValueError, match="does not match the cache's model config"):
        TieredKVCache(model.config, _gen.CFG, model=tiny_random("llama", num_layers=2, seed=1))
    with pytest.raises(ValueError, match="model_id=''"):
        TieredKVCache(model.config, _gen.CFG, model_id="")
    c = TieredKVCache(model.config, _gen.CFG, tiers="host", block_tokens=32, model=model)
    _gen.chunked_prefill(model, c, _gen.prompt(40))
    with pytest.raises(ValueError, match="holds state of another model"):
        c.bind_model(tiny_random("llama", num_layers=4, seed=2))
    c.close()


def test_generate_recovers_a_block_lost_mid_generation(model, tmp_path):
    """transformers' own decode loop: the bound model's forwards record the token ids."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from lessmem.kvcache.cache import cache_kwarg

    class DeleteBlocksAt(StoppingCriteria):
        def __init__(self, step):
            self.step, self.n = step, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.n += 1
            if self.n == self.step:
                for p in _blocks(tmp_path):
                    p.unlink()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = _gen.prompt()
    gen = dict(max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **{cache_kwarg(model): KVCache(model.config, _gen.CFG)}, **gen)
    cache = TieredKVCache(model.config, _gen.CFG, tiers=[DiskTier(tmp_path, fsync=False)], block_tokens=32,
                          device_budget="16KiB", model=model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache.prefill(model, ids[:, :-1], save=False)  # as `lessmem generate` does
        out = model.generate(ids, **{cache_kwarg(model): cache}, **gen,
                             stopping_criteria=StoppingCriteriaList([DeleteBlocksAt(5)]))
    assert torch.equal(out, ref)
    assert sum(issubclass(w.category, BlockRecoveryWarning) for w in seen) == 1
    assert cache.offload_stats()["recoveries"] >= 1
    cache.close()
