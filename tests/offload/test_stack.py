import time

import pytest
import torch

from lessmem.offload import DeviceTier, DiskTier, HostTier, RedisTier, TierFullError, TierStack


def blk(i, n=64):
    return {"x": torch.full((n,), float(i))}  # 256 B for n=64


def test_write_back_demotes_down_the_tiers(tmp_path):
    s = TierStack([DeviceTier(600, device="cpu"), HostTier(600), DiskTier(tmp_path)])
    for i in range(6):
        assert s.put(f"k{i}", blk(i)) == "device"
    assert [s.where(f"k{i}") for i in range(6)] == ["disk", "disk", "host", "host", "device", "device"]
    assert s.placement()["device"] <= 600 and s.placement()["host"] <= 600
    assert all(s.get(f"k{i}", promote=False)["x"][0].item() == i for i in range(6))


def test_promotion_on_get(tmp_path):
    s = TierStack([DeviceTier(600, device="cpu"), DiskTier(tmp_path)])
    for i in range(4):
        s.put(f"k{i}", blk(i))
    assert s.where("k0") == "disk"
    s.get("k0")
    assert s.where("k0") == "device" and s.tier("device").nbytes <= 600


def test_write_through_persists_everything(tmp_path):
    s = TierStack([HostTier(None), DiskTier(tmp_path)], write_policy="write-through")
    for i in range(3):
        s.put(f"k{i}", blk(i))
    assert sorted(DiskTier(tmp_path).keys()) == ["k0", "k1", "k2"]
    s2 = TierStack([HostTier(None), DiskTier(tmp_path)], write_policy="write-back")
    s2.put("wb", blk(9))
    assert not DiskTier(tmp_path).contains("wb")
    s2.close()  # write-back flushes on close
    assert DiskTier(tmp_path).get("wb")["x"][0].item() == 9


def test_oversize_goes_to_next_tier_and_full_stack_raises(tmp_path):
    s = TierStack([DeviceTier(100, device="cpu"), DiskTier(tmp_path, capacity=2000)])
    assert s.put("big", blk(0)) == "disk"
    with pytest.raises(TierFullError):
        s.put("huge", blk(0, n=4096))


def test_prefetch_lateness_is_recorded():
    class Slow(HostTier):
        def get(self, key):
            time.sleep(0.05)
            return super().get(key)

    s = TierStack([DeviceTier(0, device="cpu"), Slow(None)])
    s.put("a", blk(1))
    s.put("b", blk(2))
    h = s.prefetch("a")
    assert h.result()["x"][0].item() == 1  # asked at once: late
    h2 = s.prefetch("b")
    time.sleep(0.2)
    assert h2.result()["x"][0].item() == 2  # asked after it arrived: on time
    p = s.stats()["prefetch"]
    assert p["issued"] == 2 and p["late"] == 1 and p["on_time"] == 1 and p["late_seconds"] > 0.01


def test_redis_down_stack_keeps_working(tmp_path, dead_redis_url):
    s = TierStack([HostTier(300), DiskTier(tmp_path), RedisTier(dead_redis_url)],
                  write_policy="write-through")
    with pytest.warns(RuntimeWarning, match="unavailable"):
        for i in range(3):
            s.put(f"k{i}", blk(i))
    assert all(s.get(f"k{i}")["x"][0].item() == i for i in range(3))
    assert s.stats()["remote"]["errors"] >= 1


def test_bad_args():
    with pytest.raises(ValueError, match="write_policy='always'"):
        TierStack([HostTier(None)], write_policy="always")
    with pytest.raises(ValueError, match="non-empty list"):
        TierStack([])
    with pytest.raises(ValueError, match="unique"):
        TierStack([HostTier(None), HostTier(None)])
    with pytest.raises(ValueError, match="no tier named"):
        TierStack([HostTier(None)]).tier("disk")
