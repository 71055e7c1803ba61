import pytest

from lessmem.offload import (
    DiskTier,
    HostTier,
    RedisTier,
    TierSpec,
    build_tier,
    parse_bytes,
    parse_offload_spec,
)


@pytest.mark.parametrize("text,n", [("64MiB", 64 << 20), ("1.5GB", 1_500_000_000), ("512", 512),
                                    ("2k", 2048), ("3 GiB", 3 << 30), (7, 7), ("10b", 10),
                                    ("2G", 2 << 30), ("2GB", 2_000_000_000), ("1e3", 1000)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-1", True, -5, "iB4"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)


def test_one_size_rule_for_offload_and_plan():
    """--kv-budget 2G means the same bytes to generate/eval (offload) and plan (base.units)."""
    from lessmem.base import units

    assert parse_bytes is units.parse_bytes
    assert parse_offload_spec("host@2G")[0].capacity == units.parse_bytes("2GiB") == 2 << 30


def test_parse_offload_spec(tmp_path):
    specs = parse_offload_spec(f"host@1GiB, disk:{tmp_path}/kv@10MB,redis://:pw@127.0.0.1:6379/0@2MiB")
    assert [s.to_dict() for s in specs] == [
        {"kind": "host", "target": None, "capacity": 1 << 30},
        {"kind": "disk", "target": f"{tmp_path}/kv", "capacity": 10_000_000},
        {"kind": "remote", "target": "redis://:pw@127.0.0.1:6379/0", "capacity": 2 << 20},
    ]
    tiers = [build_tier(s) for s in specs]
    assert isinstance(tiers[0], HostTier) and tiers[0].capacity == 1 << 30
    assert isinstance(tiers[1], DiskTier) and (tmp_path / "kv" / "blocks").is_dir()
    assert isinstance(tiers[2], RedisTier) and tiers[2].url.endswith("6379/0")
    assert parse_offload_spec("redis://h:1/0")[0].capacity is None


@pytest.mark.parametrize("bad,match", [("", "empty"), ("gpu", "not understood"), ("disk:", "not understood"),
                                       ("host,host", "twice"), ("host@lots", "size")])
def test_parse_offload_spec_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_offload_spec(bad)


def test_tierspec_validation():
    with pytest.raises(ValueError, match="allowed: device, host, disk, remote"):
        TierSpec("tape")
    with pytest.raises(ValueError, match="needs a path"):
        TierSpec("disk")


def test_build_tiers(tmp_path):
    from lessmem.offload import build_tiers

    ts = build_tiers(f"host@1KiB,disk:{tmp_path}")
    assert [t.kind for t in ts] == ["host", "disk"] and ts[0].capacity == 1024
    assert build_tiers([TierSpec("host")])[0].capacity is None
    assert build_tiers(HostTier(5))[0].capacity == 5
    with pytest.raises(ValueError, match="no tiers"):
        build_tiers([])
    with pytest.raises(ValueError, match="allowed: Tier objects"):
        build_tiers([3])
