"""The disk tier's read-ahead hints (``advise``/``advise_async``), which the tiered cache's
"hint" prefetch uses."""

from pathlib import Path

import pytest
import torch

from lessmem.offload import DiskTier


@pytest.mark.parametrize("compiled", [True, False])
def test_disk_advise_hints_known_blocks(tmp_path, monkeypatch, compiled):
    if not compiled:
        monkeypatch.setenv("LESSMEM_NO_CPP", "1")
    t = DiskTier(tmp_path, fsync=False)
    for i in range(3):
        t.put(f"k{i}", {"x": torch.arange(8) + i})
    assert t.advise(["k0", "k2", "absent"]) == 2
    (tmp_path / "blocks" / "k1.blk").unlink()  # gone behind the store's back: skipped, no error
    assert t.advise(["k1"]) == 0


def test_disk_advise_async_from_a_native_thread_also_after_fork(tmp_path):
    import multiprocessing as mp

    from lessmem.offload import fastread

    if not fastread.available():
        pytest.skip("no compiler here")
    t = DiskTier(tmp_path, fsync=False)
    for i in range(3):
        t.put(f"k{i}", {"x": torch.arange(8) + i})
    a, b = t.advise_async(["k0", "k1"]), t.advise_async(["k2", "absent"])
    assert b > a and t.advise_done(b, wait=True) and t.advise_done(a)  # in order
    ctx = mp.get_context("fork")  # a forked child has no worker thread: it starts its own
    p = ctx.Process(target=_advise_in_child, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == 0


def _advise_in_child(path):
    t = DiskTier(path, fsync=False)
    ticket = t.advise_async(t.keys())
    raise SystemExit(0 if t.advise_done(ticket, wait=True) else 1)


def test_disk_advise_async_skips_blocks_just_read(tmp_path, monkeypatch):
    from lessmem.offload import fastread

    if not fastread.available():
        pytest.skip("no compiler here")
    t = DiskTier(tmp_path, fsync=False)
    for i in range(4):
        t.put(f"k{i}", {"x": torch.arange(8) + i})
    seen = []
    real = fastread.advise_async
    monkeypatch.setattr(fastread, "advise_async", lambda paths: seen.append(paths) or real(paths))
    keys = [f"k{i}" for i in range(4)]
    t.advise_async(keys)
    t.get_many(["k0", "k1"])  # read since: in the page cache, not advised again
    t.advise_async(keys)
    t.advise_async(keys)  # nothing read in between: all of them again
    names = [sorted(Path(p).name for p in ps) for ps in seen]
    assert names == [[f"k{i}.blk" for i in range(4)], ["k2.blk", "k3.blk"], [f"k{i}.blk" for i in range(4)]]
    t.delete("k3")
    t.get("k2")
    assert "k3" not in t._recent and t._recent == {"k2"}


def test_advise_done_never_misses_the_workers_wakeup():
    """Many tickets waited for one by one: the worker marks each done under the waiter's lock,
    so a waiter between its check and its wait is woken (before, this loop hung within a few
    thousand tickets: the notify came while no one waited yet). Run in a child with a timeout,
    so a regression fails instead of hanging the suite."""
    import subprocess
    import sys

    from lessmem.offload import fastread

    if not fastread.available():
        pytest.skip("no compiler here")
    code = ("from lessmem.offload import fastread\n"
            "for _ in range(20000):\n"
            "    assert fastread.advise_done(fastread.advise_async([]), wait=True)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("advise_done(wait=True) hung: a lost wakeup")
    assert r.returncode == 0, r.stderr[-2000:]
