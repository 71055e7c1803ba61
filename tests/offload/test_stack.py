import pytest
import torch

from lessmem.offload import (
    DeviceTier,
    DiskTier,
    HostTier,
    RedisTier,
    TierFullError,
    TierStack,
    TierUnavailableError,
)


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


class Refusing(HostTier):
    """A lower tier that stores nothing while ``error`` is set (disk full, Redis down)."""

    def __init__(self, error=TierFullError):
        super().__init__(None, name="refusing")
        self.error = error

    def put(self, key, block):
        if self.error is not None:
            raise self.error(f"{self.name} refuses {key!r}")
        super().put(key, block)


@pytest.mark.parametrize("error", [TierFullError, TierUnavailableError])
def test_a_failed_demotion_loses_no_block(error):
    low = Refusing(error)
    s = TierStack([DeviceTier(600, device="cpu"), low])
    with pytest.warns(RuntimeWarning, match="keeps block 'k0' over its capacity"):
        for i in range(4):
            assert s.put(f"k{i}", blk(i)) == "device"
    assert all(s.where(f"k{i}") == "device" for i in range(4))  # over capacity, nothing lost
    assert s.stats()["device"]["demote_failures"] == 2 and s.stats()["device"]["evictions"] == 0
    low.error = None
    s.put("k4", blk(4))  # the lower tier takes blocks again: demotion resumes
    assert [s.where(f"k{i}") for i in range(5)] == ["refusing"] * 3 + ["device"] * 2
    assert all(s.get(f"k{i}")["x"][0].item() == i for i in range(5))


def test_no_tier_takes_a_block_names_every_reason(tmp_path):
    s = TierStack([DeviceTier(100, device="cpu"), Refusing(TierUnavailableError)])
    with pytest.raises(TierFullError, match=r"no tier could take block 'big': device: .*larger.*refusing: "):
        s.put("big", blk(0))
    assert not s.contains("big")


def test_flush_keeps_what_no_lower_tier_takes():
    s = TierStack([HostTier(None), Refusing()])
    s.put("a", blk(1))
    with pytest.warns(RuntimeWarning, match="no lower tier took 1 block"):
        assert s.flush() == ["a"]
    assert s.where("a") == "host"


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
