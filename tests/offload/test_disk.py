import errno
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch
from _kill import kill_writer

from lessmem.formats import PerGroup, quantize
from lessmem.offload import DiskTier, TierFullError
from lessmem.offload import disk as disk_mod


def blk(i, n=256):
    return {"x": torch.full((n,), float(i)), "i": torch.tensor([i])}


def test_reopened_store_serves_what_it_held(tmp_path):
    q = quantize(torch.randn(1, 3, 16, 64), "uint4", granularity=PerGroup(16, axis=-2))
    with DiskTier(tmp_path) as t:
        t.put("a", {"k": q})
        t.put("b", blk(1))
        held = t.nbytes
    t2 = DiskTier(tmp_path)
    assert sorted(t2.keys()) == ["a", "b"] and t2.nbytes == held
    assert torch.equal(t2.get("a")["k"].dequantize(), q.dequantize())
    assert t2.stats.hits == 1 and t2.stats.bytes_read > 0


def _damage(f: Path, damage: str, other: Path) -> None:
    """Damage block file ``f`` in place (``other``: a valid block under another key)."""
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
        f.write_bytes(data)
    elif damage == "truncate":
        f.write_bytes(data[:-10])
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "swap":  # a valid block under the wrong name
        f.write_bytes(other.read_bytes())
    elif damage == "missing":
        f.unlink()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "swap", "missing"])
def test_damaged_block_is_a_miss_never_data(tmp_path, damage):
    t = DiskTier(tmp_path)
    t.put("a", blk(1))
    t.put("b", blk(2))
    _damage(tmp_path / "blocks" / "a.blk", damage, tmp_path / "blocks" / "b.blk")
    if damage == "missing":
        assert t.get("a") is None and t.stats.corrupt == 0
    else:
        with pytest.warns(RuntimeWarning, match="corrupt"):
            assert t.get("a") is None
        assert t.stats.corrupt == 1 and (tmp_path / "blocks" / "a.blk.corrupt").exists()
    assert t.stats.misses == 1 and not t.contains("a") and "a" not in t.keys()
    assert t.get("b")["i"].item() == 2


def test_capacity_evicts_lru_and_rejects_oversize(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "k0"}))
    t = DiskTier(tmp_path, capacity=3 * one)
    for i in range(3):
        t.put(f"k{i}", blk(i))
    t.get("k0")
    t.put("k3", blk(3))
    assert sorted(t.keys()) == ["k0", "k2", "k3"] and t.nbytes <= t.capacity
    assert not (tmp_path / "blocks" / "k1.blk").exists()
    with pytest.raises(TierFullError, match="larger than"):
        t.put("big", blk(0, n=10000))
    assert not t.contains("big") and not list((tmp_path / "blocks").glob(disk_mod.TEMP_PREFIX + "*"))


def test_disk_full_leaves_no_partial_block(tmp_path, monkeypatch):
    t = DiskTier(tmp_path)
    t.put("ok", blk(0))
    real_fsync = os.fsync

    def enospc(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod.os, "fsync", enospc)
    with pytest.raises(TierFullError, match="full"):
        t.put("new", blk(1))
    monkeypatch.setattr(disk_mod.os, "fsync", real_fsync)
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == ["ok.blk"]
    assert not t.contains("new") and DiskTier(tmp_path).keys() == ["ok"]


def test_kill_9_during_writes_loses_nothing_reported(tmp_path):
    reported = kill_writer(tmp_path)
    # the writer was killed mid-stream: a temp file of a dead pid may remain, never a .blk
    t = DiskTier(tmp_path)  # reopening removes temp files of dead writers
    assert not list((tmp_path / "blocks").glob(disk_mod.TEMP_PREFIX + "*"))
    for key in reported:
        b = t.get(key)
        assert b is not None, key
        i = int(key[3:])
        assert b["i"].item() == i and torch.equal(b["x"], torch.full((20000,), float(i)))
    assert t.stats.corrupt == 0 and len(t.keys()) >= len(reported)


def test_threads_over_one_shared_store(tmp_path):
    stores = [DiskTier(tmp_path) for _ in range(4)]
    errors = []

    def work(w):
        try:
            for i in range(30):
                key = f"k{i % 10}"  # every thread writes the same keys with the same content
                stores[w].put(key, blk(i % 10))
                got = stores[(w + 1) % 4].get(key)
                if got is not None:
                    assert got["i"].item() == i % 10
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    [x.start() for x in th]
    [x.join() for x in th]
    assert not errors
    fresh = DiskTier(tmp_path)
    assert sorted(fresh.keys()) == sorted(f"k{i}" for i in range(10))
    assert all(fresh.get(f"k{i}")["i"].item() == i for i in range(10)) and fresh.stats.corrupt == 0


def test_bad_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a usable directory"):
        DiskTier(f)
    for bad in (None, "", 3):
        with pytest.raises(ValueError, match="allowed: a directory path"):
            DiskTier(bad)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "swap", "missing", "none"])
def test_get_many_equals_get_and_never_returns_damaged_data(tmp_path, monkeypatch, fast, damage):
    # the batched (compiled, GIL-free) reader checks what get checks; a block that fails
    # there is read again through get, which reports it
    from lessmem.offload import fastread

    if not fast:
        monkeypatch.setenv("LESSMEM_NO_CPP", "1")
    assert fastread.available() is fast
    t = DiskTier(tmp_path)
    keys = [f"k{i}" for i in range(5)]
    for i, k in enumerate(keys):
        t.put(k, {"codes": torch.randint(0, 255, (1, 3, 16, 32), dtype=torch.uint8), "i": torch.tensor([i]),
                  "s": torch.rand(1, 3, 16, 1).half()})
    want = [t.get(k) for k in keys]
    _damage(tmp_path / "blocks" / "k2.blk", damage, tmp_path / "blocks" / "k1.blk")
    hits = t.stats.hits
    if damage in ("none", "missing"):
        got = t.get_many(keys)
    else:
        with pytest.warns(RuntimeWarning, match="corrupt"):
            got = t.get_many(keys)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i == 2 and damage != "none":
            assert g is None
        else:
            assert g.keys() == w.keys() and all(torch.equal(g[n], w[n]) for n in w)
            assert g["s"].dtype == torch.float16 and g["codes"].shape == (1, 3, 16, 32)
    assert t.stats.hits - hits == (5 if damage == "none" else 4)
    assert t.get_many([]) == []


def test_get_many_with_qtensor_blocks_and_unseen_keys(tmp_path):
    q = quantize(torch.randn(1, 3, 16, 64), "uint4", granularity=PerGroup(16, axis=-2))
    DiskTier(tmp_path).put("q", {"k": q})
    DiskTier(tmp_path).put("p", blk(3))
    t = DiskTier(tmp_path)  # reopened: nothing read yet, so both take the checked path first
    got = t.get_many(["q", "p", "absent"])
    assert torch.equal(got[0]["k"].dequantize(), q.dequantize()) and got[1]["i"].item() == 3
    assert got[2] is None and t.stats.misses == 1
    again = t.get_many(["p", "q"])  # p now through the batched reader
    assert again[0]["i"].item() == 3 and torch.equal(again[1]["k"].dequantize(), q.dequantize())


def test_compiled_crc32_equals_zlib():
    # the batched reader's carry-less-multiplication CRC-32 must be zlib's, bit for bit
    import random
    import zlib

    from lessmem.offload import fastread

    if not fastread.available():
        pytest.skip("no compiler here")
    rng = random.Random(0)
    lengths = list(range(0, 300)) + [rng.randrange(300, 1 << 20) for _ in range(40)]
    for n in lengths:
        data, init = rng.randbytes(n), rng.getrandbits(32)
        assert fastread.crc32(data, init) == zlib.crc32(data, init), n
    assert fastread.crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value


def test_get_many_never_overwrites_blocks_a_caller_still_holds(tmp_path):
    # reads land in reused buffers; a buffer is reused only once no returned tensor views it
    from lessmem.offload import fastread

    if not fastread.available():
        pytest.skip("no compiler here")
    t = DiskTier(tmp_path)
    keys = [f"k{i}" for i in range(4)]
    for i, k in enumerate(keys):
        t.put(k, {"codes": torch.full((1, 3, 64, 32), i, dtype=torch.uint8), "i": torch.tensor([i])})
    held = t.get_many(keys)
    for rnd in range(1, 6):  # new contents under the same keys, read while `held` is alive
        for i, k in enumerate(keys):
            t.put(k, {"codes": torch.full((1, 3, 64, 32), 10 * rnd + i, dtype=torch.uint8),
                      "i": torch.tensor([10 * rnd + i])})
        got = t.get_many(keys)
        assert [g["i"].item() for g in got] == [10 * rnd + i for i in range(4)]
        assert all(torch.all(g["codes"] == 10 * rnd + i) for i, g in enumerate(got))
        assert [h["i"].item() for h in held] == [0, 1, 2, 3]
        assert all(torch.all(h["codes"] == i) for i, h in enumerate(held))
    del got, held
    again = t.get_many(keys)
    assert all(torch.all(g["codes"] == 50 + i) for i, g in enumerate(again))


def test_get_many_serves_a_block_a_peer_rewrote_with_another_size(tmp_path):
    t = DiskTier(tmp_path)
    t.put("a", {"x": torch.arange(4)})
    assert t.get_many(["a"])[0]["x"].tolist() == [0, 1, 2, 3]
    DiskTier(tmp_path).put("a", {"x": torch.arange(9)})  # another process replaces it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not corruption: no warning
        assert t.get_many(["a"])[0]["x"].tolist() == list(range(9))
    assert t.stats.corrupt == 0 and t.get_many(["a"])[0]["x"].tolist() == list(range(9))
