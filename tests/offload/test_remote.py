import subprocess
import sys
import threading

import pytest
import torch

from lessmem.offload import RedisTier, TierUnavailableError
from lessmem.offload.hashing import layer_key, prefix_hashes


def blk(i):
    return {"x": torch.full((128,), float(i)), "i": torch.tensor([i])}


def test_put_get_delete(redis_server):
    t = RedisTier(redis_server.url, prefix="t1:")
    t.put("a", blk(1))
    assert t.contains("a") and t.get("a")["i"].item() == 1 and t.nbytes > 0
    assert t.stats.hits == 1 and t.stats.bytes_read > 0 and t.stats.read_gbps > 0
    assert t.delete("a") and not t.contains("a") and t.get("a") is None and t.nbytes == 0
    t.close()


def test_other_process_hits_same_prefix(redis_server):
    toks = list(range(64))
    keys = [layer_key(h, 0) for h in prefix_hashes(toks, 16, "m", {"bits": 4})]
    t = RedisTier(redis_server.url)
    for i, k in enumerate(keys):
        t.put(k, blk(i))
    code = (
        "import sys; from lessmem.offload import RedisTier, prefix_hashes, layer_key\n"
        "t = RedisTier(sys.argv[1])\n"
        "ks = [layer_key(h, 0) for h in prefix_hashes(list(range(64)), 16, 'm', {'bits': 4})]\n"
        "print(sum(int(t.get(k)['i'].item() == i) for i, k in enumerate(ks)), t.stats.hits)\n")
    out = subprocess.run([sys.executable, "-c", code, redis_server.url], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["4", "4"]


def test_corrupt_value_is_a_miss(redis_server):
    t = RedisTier(redis_server.url, prefix="c:")
    t.put("a", blk(1))
    raw = bytearray(t.client.get("c:a"))
    raw[-1] ^= 0xFF
    t.client.set("c:a", bytes(raw))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert t.get("a") is None
    assert t.stats.corrupt == 1 and not t.contains("a")


def test_capacity_evicts_own_lru(redis_server):
    t = RedisTier(redis_server.url, prefix="cap:", capacity=2200)
    for i in range(5):
        t.put(f"k{i}", blk(i))  # ~0.7 KB each: 3 fit
    assert t.nbytes <= 2200 and t.stats.evictions == 2
    assert not t.contains("k0") and t.contains("k4")


def test_server_down_warns_and_misses(dead_redis_url):
    t = RedisTier(dead_redis_url, retry_after=60)
    # a put that stored nothing says so (the caller keeps the block): never a silent drop
    with pytest.warns(RuntimeWarning, match="unavailable"), pytest.raises(TierUnavailableError):
        t.put("a", blk(1))
    assert t.get("a") is None and not t.contains("a") and t.stats.errors >= 3
    assert not t.available and t.nbytes == 0


def test_server_dies_mid_use(redis_server):
    t = RedisTier(redis_server.url, retry_after=0.0)
    t.put("a", blk(1))
    redis_server.stop()
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert t.get("a") is None
    assert t.stats.errors >= 1


def test_threads_share_one_server(redis_server):
    errs = []

    def work(w):
        t = RedisTier(redis_server.url, prefix="th:")
        try:
            for i in range(40):
                t.put(f"k{i % 8}", blk(i % 8))
                got = t.get(f"k{(i + w) % 8}")
                assert got is None or got["i"].item() == (i + w) % 8
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ths = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    [x.start() for x in ths]
    [x.join() for x in ths]
    assert not errs


def test_bad_args():
    with pytest.raises(ValueError, match="must start with redis://"):
        RedisTier("http://x")
    with pytest.raises(ValueError, match="ttl=0"):
        RedisTier("redis://127.0.0.1:1/0", ttl=0)
    with pytest.raises(ValueError, match="retry_after='5'"):
        RedisTier("redis://127.0.0.1:1/0", retry_after="5")
    with pytest.raises(ValueError, match="socket_timeout=-1"):
        RedisTier("redis://127.0.0.1:1/0", socket_timeout=-1)
    with pytest.raises(ValueError, match="prefix=None"):
        RedisTier("redis://127.0.0.1:1/0", prefix=None)
