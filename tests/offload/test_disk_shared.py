"""One store directory shared by several processes: capacity, eviction, lost blocks,
orphaned sessions of killed processes, and the write-behind queue under kill -9."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _kill import kill_writer

from lessmem.offload import DiskTier, TierFullError
from lessmem.offload import disk as disk_mod

HERE = Path(__file__).parent
SESSION = "0123456789abcdef"


def blk(i, n=1000):
    return {"x": torch.full((n,), float(i)), "i": torch.tensor([i])}


def _on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "blocks").glob("*.blk"))


def test_capacity_holds_across_processes_and_lost_blocks_are_misses(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "a0"}))
    cap = 10 * one
    procs = [subprocess.Popen([sys.executable, str(HERE / "_shared.py"), str(tmp_path), str(cap), a, "60", b],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a, b in (("a", "b"), ("b", "a"))]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        ok, hits, misses, wrong = out.split()
        assert ok == "ok" and wrong == "0"
    assert sum(int(o.split()[2]) for o, _ in outs) > 0  # some blocks were lost to the peer
    t = DiskTier(tmp_path, capacity=cap)
    assert _on_disk(tmp_path) <= cap and t.nbytes == _on_disk(tmp_path)
    assert not list((tmp_path / "blocks").glob(disk_mod.TEMP_PREFIX + "*"))


def test_two_stores_in_one_process_share_the_capacity(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "a0"}))
    a, b = DiskTier(tmp_path, capacity=4 * one), DiskTier(tmp_path, capacity=4 * one)
    for i in range(6):
        a.put(f"a{i}", blk(i))
        b.put(f"b{i}", blk(i))
        assert _on_disk(tmp_path) <= 4 * one
    assert a.nbytes == b.nbytes == _on_disk(tmp_path)


def test_a_block_a_peer_evicted_is_a_miss_in_every_read_path(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "a0"}))
    a, b = DiskTier(tmp_path), DiskTier(tmp_path, capacity=3 * one)
    b.put("b0", blk(0))
    b.put("b1", blk(1))
    for _ in range(2):  # the second time through the batched (compiled) reader
        assert [x["i"].item() for x in a.get_many(["b0", "b1"])] == [0, 1]
    for i in range(2, 5):
        b.put(f"b{i}", blk(i))  # b evicts b0, b1
    assert not (tmp_path / "blocks" / "b0.blk").exists()
    assert a.get_many(["b0", "b1"]) == [None, None] and a.get("b0") is None
    assert not a.contains("b1") and a.stats.corrupt == 0 and a.stats.misses == 3
    assert [x["i"].item() for x in a.get_many(["b2", "b4"])] == [2, 4]


def test_a_holder_killed_inside_the_lock_is_recounted(tmp_path):
    t = DiskTier(tmp_path)
    t.put("a", blk(1))
    fd = os.open(tmp_path / "lock", os.O_WRONLY)
    os.pwrite(fd, b"7 1".ljust(31) + b"\n", 0)  # a wrong count, left "dirty"
    os.close(fd)
    t.put("b", blk(2))  # the next holder recounts from the directory
    assert t.nbytes == _on_disk(tmp_path)


def _hold(tmp_path):
    p = subprocess.Popen([sys.executable, str(HERE / "_writer.py"), str(tmp_path), "hold", SESSION],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_sessions_of_a_killed_process_are_reclaimed_at_open(tmp_path):
    p = _hold(tmp_path)
    try:
        live = DiskTier(tmp_path)  # the writer lives: its session blocks stay
        assert sum(k.startswith("s" + SESSION) for k in live.keys()) == 8
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    fresh = DiskTier(tmp_path)
    assert sorted(fresh.keys()) == sorted(f"shared{i}" for i in range(8))  # shareable blocks stay
    assert not list((tmp_path / "blocks").glob(f"s{SESSION}*"))
    assert fresh.nbytes == _on_disk(tmp_path)
    assert len(list((tmp_path / "clients").iterdir())) == 2  # live's and fresh's


def test_sessions_of_a_killed_process_are_reclaimed_before_evicting(tmp_path):
    one = len(disk_mod.pack_block(blk(0, 20000), meta={"key": "k"}))
    t = DiskTier(tmp_path, capacity=18 * one)
    p = _hold(tmp_path)  # 16 blocks of 20000 floats: 4 more do not fit beside them
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t.store._last_check = 0.0  # (looked at most once a second)
    for i in range(4):
        t.put(f"mine{i}", blk(i, 20000))
    assert t.stats.evictions == 0  # the orphans made room, not our blocks or the shared ones
    assert not list((tmp_path / "blocks").glob(f"s{SESSION}*"))
    assert t.nbytes == _on_disk(tmp_path) and len(list((tmp_path / "blocks").glob("*.blk"))) == 12


def test_own_sessions_survive_and_end_with_close(tmp_path):
    t = DiskTier(tmp_path)
    t.put(f"s{SESSION}-b00000-L00", blk(1))
    peer = DiskTier(tmp_path)  # sees t's session as live
    assert peer.get(f"s{SESSION}-b00000-L00")["i"].item() == 1
    t.close()
    assert sorted(DiskTier(tmp_path).keys()) == []  # t left: its session is reclaimed


def test_put_async_acknowledges_only_after_fsync(tmp_path, monkeypatch):
    t = DiskTier(tmp_path)
    gate, real_fsync = threading.Event(), os.fsync

    def slow_fsync(fd):
        assert gate.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(disk_mod.os, "fsync", slow_fsync)
    fut = t.put_async("a", blk(5))
    assert t.get("a")["i"].item() == 5 and t.contains("a")  # pending, served from the queue
    assert not fut.done() and not (tmp_path / "blocks" / "a.blk").exists()
    gate.set()
    assert fut.result(timeout=30) is None and (tmp_path / "blocks" / "a.blk").exists()
    t.flush()
    assert DiskTier(tmp_path).get("a")["i"].item() == 5


def test_put_async_errors_reach_the_future_and_flush_waits(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "k0"}))
    t = DiskTier(tmp_path, capacity=one)
    futs = [t.put_async(f"k{i}", blk(i)) for i in range(5)]
    big = t.put_async("big", blk(0, n=5000))
    t.flush()
    assert all(f.done() for f in futs) and all(f.exception() is None for f in futs)
    assert isinstance(big.exception(), TierFullError) and not t.contains("big")
    assert t.keys() == ["k4"] and t.get("k4")["i"].item() == 4
    with pytest.raises(ValueError, match="invalid"):
        t.put_async("bad key", blk(0))
    with pytest.raises(ValueError, match="max_pending"):
        DiskTier(tmp_path / "x", max_pending=0)
    t.close()


def test_kill_9_during_async_writes_loses_nothing_acknowledged(tmp_path):
    reported = kill_writer(tmp_path, "async")
    t = DiskTier(tmp_path)
    assert not list((tmp_path / "blocks").glob(disk_mod.TEMP_PREFIX + "*"))
    for key in reported:
        b = t.get(key)
        assert b is not None, key
        i = int(key[3:])
        assert b["i"].item() == i and torch.equal(b["x"], torch.full((20000,), float(i)))
    assert t.stats.corrupt == 0


def test_a_forked_child_takes_its_own_lock(tmp_path):
    import multiprocessing as mp

    t = DiskTier(tmp_path)
    t.put("a", blk(1))

    def child(q):  # the parent holds the store lock now: the child must not get it too
        import fcntl

        try:
            fcntl.flock(t.store._lock_fd(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            q.put("got the lock")
        except BlockingIOError:
            q.put("excluded")

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with t.store.locked():
        p = ctx.Process(target=child, args=(q,))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
    assert got == "excluded"
    t.close()
    assert t.nbytes == _on_disk(tmp_path)


def test_write_behind_group_commits_what_is_queued(tmp_path, monkeypatch):
    t = DiskTier(tmp_path)
    gate, entered, real_fsync, dir_syncs = threading.Event(), threading.Event(), os.fsync, []

    def gated_fsync(fd):
        if not entered.is_set():  # hold the first write while the rest queue up
            entered.set()
            assert gate.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(disk_mod.os, "fsync", gated_fsync)
    real_dir = t.store.fsync_dir
    monkeypatch.setattr(t.store, "fsync_dir", lambda: (dir_syncs.append(1), real_dir()))
    futs = [t.put_async("k0", blk(0))]
    assert entered.wait(30)
    futs += [t.put_async(f"k{i}", blk(i)) for i in range(1, 10)]
    gate.set()
    t.flush()
    assert all(f.result() is None for f in futs) and len(dir_syncs) == 2  # 1 + the 9 queued
    assert [DiskTier(tmp_path).get(f"k{i}")["i"].item() for i in range(10)] == list(range(10))


def test_put_many_reports_each_item(tmp_path):
    one = len(disk_mod.pack_block(blk(0), meta={"key": "k0"}))
    t = DiskTier(tmp_path, capacity=3 * one)
    errs = t.put_many([("k0", blk(0)), ("bad key", blk(1)), ("big", blk(2, n=9000)), ("k3", blk(3))])
    assert errs[0] is None and errs[3] is None
    assert isinstance(errs[1], ValueError) and isinstance(errs[2], TierFullError)
    assert sorted(t.keys()) == ["k0", "k3"] and t.stats.puts == 2
    assert not list((tmp_path / "blocks").glob(disk_mod.TEMP_PREFIX + "*"))
