import pytest
import torch

from lessmem.formats import PerGroup, quantize
from lessmem.offload import DeviceTier, HostTier, TierFullError


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


def test_pins_are_never_evicted():
    t = DeviceTier(capacity=600, device="cpu")
    t.put("sink", blk(64))
    t.pin("sink")
    t.put("a", blk(64))
    t.put("b", blk(64))
    assert t.contains("sink") and not t.contains("a")
    t.pin("b")
    with pytest.raises(TierFullError, match="pinned"):
        t.put("c", blk(100))
    with pytest.raises(TierFullError, match="larger than"):
        t.put("d", blk(1000))
    t.unpin("b")
    t.put("c", blk(64))
    assert t.contains("sink") and t.contains("c") and not t.contains("b")


def test_qtensor_bytes_counted_honestly():
    q = quantize(torch.randn(4, 128), "uint4", granularity=PerGroup(32))
    t = DeviceTier(capacity=None, device="cpu")
    t.put("q", {"k": q})
    assert t.nbytes == q.nbytes
    assert torch.equal(t.get("q")["k"].dequantize(), q.dequantize())
    t.put("q", {"k": q})  # replace: no double count
    assert t.nbytes == q.nbytes
    assert t.delete("q") and t.nbytes == 0 and not t.delete("q")


def test_get_async_and_misses():
    t = HostTier(capacity=None)
    t.put("a", blk(4, 2.0))
    assert t.get_async("a").result()["x"].tolist() == [2.0] * 4
    assert t.get_async("zz").result() is None and t.stats.misses == 1
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
    t.pin("k0")
    assert t.get("k1", touch=False) is not None  # a peek keeps k1 least recent
    t.resize(600)
    assert evicted == ["k1", "k2"] and t.keys() == ["k0", "k3"] and t.nbytes <= 600
    with pytest.raises(ValueError, match="capacity=-3"):
        t.resize(-3)
