import warnings

import pytest
import torch

from lessmem.formats import PerGroup, quantize
from lessmem.offload import DeviceTier, HostTier, TierFullError, TierUnavailableError


def blk(n_floats, v=0.0):
    return {"x": torch.full((n_floats,), float(v))}


def test_lru_eviction_order_and_budget():
    t = HostTier(capacity=1000)
    evicted = []
    t.on_evict = lambda k, b: evicted.append((k, b["x"][0].item()))
    for i in range(3):
        t.put(f"b{i}", blk(64, i))  # 256 B each
    assert t.get("b0") is not None  # b0 becomes most recent
    t.put("b3", blk(64, 3))
    assert evicted == [("b1", 1.0)] and t.keys() == ["b2", "b0", "b3"]
    assert t.nbytes == 768 <= t.capacity
    assert t.stats.hits == 1 and t.stats.evictions == 1


def test_a_block_larger_than_the_tier_is_refused():
    t = DeviceTier(capacity=600, device="cpu")
    t.put("a", blk(64))
    with pytest.raises(TierFullError, match="larger than"):
        t.put("d", blk(1000))
    assert t.keys() == ["a"] and t.nbytes == 256


@pytest.mark.parametrize("error", [TierFullError, TierUnavailableError])
def test_a_block_no_lower_tier_takes_stays_with_one_warning(error):
    t = HostTier(capacity=600)

    def refuse(key, block):
        raise error("the tier below is full or unreachable")

    t.on_evict = refuse
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(5):
            t.put(f"b{i}", blk(64, i))  # 256 B each: from the third on, evictions fail
        t.resize(100)
    assert len([w for w in seen if "no lower tier could take it" in str(w.message)]) == 1
    assert t.keys() == [f"b{i}" for i in range(5)] and t.nbytes == 5 * 256  # nothing lost
    assert t.stats.demote_failures == 4 and t.stats.evictions == 0
    assert all(t.get(f"b{i}")["x"][0].item() == i for i in range(5))
    t.on_evict = lambda k, b: None  # the tier below takes blocks again: eviction resumes
    t.resize(600)
    t.put("b5", blk(64, 5))
    assert t.keys() == ["b4", "b5"] and t.stats.evictions == 4


def test_eviction_reads_only_the_least_recent_blocks():
    """O(1) per put: the LRU order is walked only as far as the blocks to evict."""
    from collections import OrderedDict

    class Counting(OrderedDict):
        steps = 0

        def items(self):
            for kv in super().items():
                Counting.steps += 1
                yield kv

    t = HostTier(capacity=256 * 2000)
    for i in range(2000):
        t.put(f"k{i}", blk(64, i))
    t._blocks = Counting(t._blocks)
    t.put("new", blk(64))
    assert Counting.steps <= 2 and t.keys()[0] == "k1" and t.nbytes == 256 * 2000

def test_qtensor_bytes_counted_honestly():
    q = quantize(torch.randn(4, 128), "uint4", granularity=PerGroup(32))
    t = DeviceTier(capacity=None, device="cpu")
    t.put("q", {"k": q})
    assert t.nbytes == q.nbytes
    assert torch.equal(t.get("q")["k"].dequantize(), q.dequantize())
    t.put("q", {"k": q})  # replace: no double count
    assert t.nbytes == q.nbytes
    assert t.delete("q") and t.nbytes == 0 and not t.delete("q")


def test_get_and_misses():
    t = HostTier(capacity=None)
    t.put("a", blk(4, 2.0))
    assert t.get("a")["x"].tolist() == [2.0] * 4
    assert t.get("zz") is None and t.stats.misses == 1
    t.close()


def test_bad_input():
    with pytest.raises(ValueError, match="capacity=-1"):
        HostTier(capacity=-1)
    with pytest.raises(ValueError, match="block key"):
        HostTier(None).put("a/b", blk(1))
    with pytest.raises(ValueError, match="allowed: torch.Tensor, QTensor"):
        HostTier(None).put("a", {"x": 3})


def test_resize_and_peek():
    t = HostTier(capacity=None)
    evicted = []
    t.on_evict = lambda k, b: evicted.append(k)
    for i in range(4):
        t.put(f"k{i}", blk(64, i))
    assert t.get("k0") is not None  # a read makes k0 the most recent
    assert t.get("k1", touch=False) is not None  # a peek keeps k1 least recent
    t.resize(600)
    assert evicted == ["k1", "k2"] and t.keys() == ["k3", "k0"] and t.nbytes <= 600
    with pytest.raises(ValueError, match="capacity=-3"):
        t.resize(-3)
