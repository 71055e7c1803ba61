"""Redis faults against a real redis-server: killed mid-run, down from the start, restarted
empty, full under ``noeviction``, evicting under ``allkeys-lru``. Nothing acknowledged is
lost silently (a put that fails raises TierUnavailableError), nothing wrong is returned,
each kind of trouble warns once, and the password never shows."""

import warnings

import pytest
import torch

from lessmem.base.tierspec import TierSpec, format_offload_spec, parse_offload_spec, redact_url
from lessmem.offload import RedisTier, TierUnavailableError

PASSWORD = "hunter2-secret"


def blk(i, n=128):
    return {"x": torch.full((n,), float(i)), "i": torch.tensor([i])}


def _url(srv, password=None):
    return f"redis://:{password}@127.0.0.1:{srv.port}/0" if password else srv.url


def _messages(caught):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_killed_mid_run_put_raises_reads_miss_one_warning(redis_proc):
    srv = redis_proc.start(password=PASSWORD)
    t = RedisTier(_url(srv, PASSWORD), retry_after=0.0)
    for i in range(4):
        t.put(f"k{i}", blk(i))
    srv.kill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            assert t.get(f"k{i}") is None and not t.contains(f"k{i}")
            with pytest.raises(TierUnavailableError, match="nothing stored") as e:
                t.put(f"n{i}", blk(i))
            assert PASSWORD not in str(e.value) and "***" in str(e.value)
    msgs = _messages(caught)
    assert len(msgs) == 1 and "unavailable" in msgs[0] and "remote tier" in msgs[0], msgs
    assert PASSWORD not in msgs[0] and ":***@" in msgs[0]
    assert t.stats.errors >= 12 and t.stats.misses == 4 and t.stats.puts == 4
    assert PASSWORD not in repr(t) and PASSWORD not in t.url
    t.close()


def test_down_from_the_start_within_retry_window(dead_redis_url):
    t = RedisTier(dead_redis_url, retry_after=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            with pytest.raises(TierUnavailableError):
                t.put(f"k{i}", blk(i))
            assert t.get(f"k{i}") is None
    assert len(_messages(caught)) == 1 and t.nbytes == 0 and t.stats.puts == 0
    assert t.stats.errors == 10 and t.stats.misses == 5


def test_restarted_empty_means_misses_with_one_warning_then_works(redis_proc):
    srv = redis_proc.start()
    t = RedisTier(srv.url, retry_after=0.0)
    for i in range(5):
        t.put(f"k{i}", blk(i))
    srv.kill()
    srv.start()  # same port, no data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [t.get(f"k{i}") for i in range(5)]
    assert got == [None] * 5
    msgs = _messages(caught)
    assert sum("is gone" in m for m in msgs) == 1, msgs
    assert t.nbytes == 0  # the lost blocks are no longer counted as held
    t.put("k0", blk(7))
    assert t.get("k0")["i"].item() == 7


def test_noeviction_full_server_raises_unavailable_never_raw_error(redis_proc):
    srv = redis_proc.start("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    t = RedisTier(srv.url)
    stored, refused = [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(400):  # ~64 KB each: far beyond 3 MB
            try:
                t.put(f"k{i}", blk(i, n=16384))
                stored.append(i)
            except TierUnavailableError as e:
                assert "OutOfMemoryError" in str(e) and "nothing stored" in str(e)
                refused += 1
    assert stored and refused > 100
    msgs = _messages(caught)
    assert len(msgs) == 1 and "refused" in msgs[0], msgs
    for i in stored:  # everything acknowledged is there and right
        assert t.get(f"k{i}")["i"].item() == i
    assert t.stats.errors == refused


def test_allkeys_lru_eviction_is_misses_never_wrong_data(redis_proc):
    srv = redis_proc.start("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    t = RedisTier(srv.url)
    n = 300  # ~64 KB each, ~19 MB in all: the server evicts most of them
    for i in range(n):
        t.put(f"k{i}", blk(i, n=16384))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [t.get(f"k{i}") for i in range(n)]
    hits = [i for i, b in enumerate(got) if b is not None]
    assert 0 < len(hits) < n // 2
    assert all(torch.equal(got[i]["x"], torch.full((16384,), float(i))) for i in hits)
    msgs = _messages(caught)
    assert sum("is gone" in m for m in msgs) == 1 and t.stats.misses == n - len(hits)


def test_error_reply_on_get_is_a_counted_miss(redis_proc):
    srv = redis_proc.start()
    t = RedisTier(srv.url, prefix="p:")
    t.client.lpush("p:list", b"x")  # WRONGTYPE for GET
    with pytest.warns(RuntimeWarning, match="refused"):
        assert t.get("list") is None
    assert t.stats.errors == 1 and t.stats.misses == 1


def test_password_redacted_in_specs_and_bad_url_errors():
    url = f"redis://user:{PASSWORD}@10.1.2.3:6379/2"
    spec = parse_offload_spec(f"host@1MiB,{url}@64MiB")
    text = format_offload_spec(spec)
    assert PASSWORD not in text and "redis://user:***@10.1.2.3:6379/2@64MiB" in text
    assert spec[1].to_text(reveal=True) == f"{url}@64MiB"
    assert PASSWORD not in str(redact_url(spec[1].to_dict()["target"]))
    assert TierSpec("remote", "redis://10.0.0.1:6379/0").to_text() == "redis://10.0.0.1:6379/0"
    assert redact_url(f"redis://h:1/0?password={PASSWORD}&db=1") == "redis://h:1/0?password=***&db=1"
    assert redact_url("redis://:p/a?s#s@h:1/0") == "redis://:***@h:1/0"  # unescaped characters
    with pytest.raises(ValueError) as e:
        RedisTier(f"http://:{PASSWORD}@h/0")
    assert PASSWORD not in str(e.value)


def test_behind_a_host_tier_redis_dying_loses_nothing_the_host_holds(redis_proc):
    from lessmem.offload import HostTier, TierStack
    from lessmem.offload.serialize import block_nbytes

    srv = redis_proc.start()
    host = HostTier(capacity=2 * block_nbytes(blk(0)))
    s = TierStack([host, RedisTier(srv.url, retry_after=0.0)])
    for i in range(4):
        s.put(f"k{i}", blk(i))  # k0, k1 demoted to Redis
    assert s.where("k0") == "remote"
    srv.kill()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i in range(4, 8):
            s.put(f"k{i}", blk(i))  # no lower tier takes demotions now: the host keeps them
        got = {i: s.get(f"k{i}") for i in range(8)}
    assert got[0] is None and got[1] is None  # lost with the server: misses, recomputed by the cache
    assert all(got[i]["i"].item() == i for i in range(2, 8))
    assert host.stats.demote_failures > 0


def test_password_redacted_in_plan_rows_and_eval_details():
    import json

    from lessmem.base.tierspec import redact_offload_text
    from lessmem.eval.caches import resolve_config, with_offload
    from lessmem.plan.kv import get_kv
    from lessmem.plan.models import get_model
    from lessmem.plan.tiers import tier_split

    off = f"host@8MiB,redis://:{PASSWORD}@10.0.0.9:6379/0@1GiB"
    assert redact_offload_text(off) == "host@8MiB,redis://:***@10.0.0.9:6379/0@1GiB"
    split = tier_split(get_model("smollm2-135m"), get_kv("lessmem:int4"), 4096, kv_budget="16MiB", offload=off)
    assert PASSWORD not in json.dumps(split) and split["tiers"][-1]["target"] == "redis://:***@10.0.0.9:6379/0"
    spec = with_offload(resolve_config("int4"), off, "64KiB")
    assert PASSWORD not in json.dumps(spec.detail, default=str)
