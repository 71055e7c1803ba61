"""free_cores: idle cores from /proc/stat samples, and what eval/generate do with it."""

import pytest

from lessmem.base import cpu


def _samples(monkeypatch, *pairs):
    it = iter(pairs)
    monkeypatch.setattr(cpu, "_cpu_times", lambda: next(it))
    monkeypatch.setattr(cpu.time, "sleep", lambda s: None)


@pytest.mark.parametrize("idle, total, machine, want", [
    (200, 200, 2, 2),   # nothing else ran
    (100, 200, 2, 1),   # one core's worth of other work on two
    (0, 200, 2, 1),     # everything busy: still one thread
    (130, 200, 2, 1),   # a core 30% busy is not free
    (300, 400, 4, 3),
])
def test_free_cores_from_idle_share(monkeypatch, idle, total, machine, want):
    _samples(monkeypatch, (1000, 5000), (1000 + idle, 5000 + total))
    monkeypatch.setattr(cpu, "usable_cores", lambda: machine)
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: machine)
    assert cpu.free_cores(0.0) == want


def test_no_proc_stat_means_every_core(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_times", lambda: None)
    assert cpu.free_cores(0.0) == cpu.usable_cores()


def test_idle_share_bounds():
    assert cpu.idle_share((0, 0), (0, 0)) == 1.0
    assert cpu.idle_share((10, 100), (60, 200)) == 0.5


def test_set_threads_uses_no_more_than_the_free_cores(monkeypatch, capsys):
    import torch

    from lessmem.eval import generate_cli

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "free_cores", lambda sample_s=0.1: 1)
    try:
        torch.set_num_threads(2)
        generate_cli.set_threads(None)
        assert torch.get_num_threads() == 1
        assert "using 1 thread" in capsys.readouterr().err
        generate_cli.set_threads(2)  # --threads wins
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # so does the environment
        generate_cli.set_threads(None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_HEAP_PROBE = r"""
import ctypes, json, sys
from lessmem.base import cpu

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = cpu.tune_heap()
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)  # 8 MiB: over glibc's starting mmap threshold (128 KiB)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"tuned": tuned, "again": cpu.tune_heap(), "mapped": mapped}))
"""


def _heap_probe(**env):
    import json
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("LESSMEM_TUNE_HEAP", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _glibc() -> bool:
    """glibc 2.33 or later (``mallinfo2``)."""
    import platform

    lib, version = platform.libc_ver()
    try:
        return lib == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 33)
    except ValueError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc 2.33+ (mallopt, mallinfo2)")
def test_tune_heap_serves_blocks_of_a_few_mib_from_the_heap():
    # tuned: an 8 MiB block comes from the heap (its pages stay for the next one); untuned,
    # glibc maps it on its own and unmaps it on free (the next block faults its pages in again)
    got = _heap_probe()
    assert got == {"tuned": True, "again": True, "mapped": 0}


@pytest.mark.skipif(not _glibc(), reason="glibc 2.33+ (mallopt, mallinfo2)")
@pytest.mark.parametrize("env", [{"LESSMEM_TUNE_HEAP": "0"}, {"LESSMEM_TUNE_HEAP": "off"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1000000"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}])
def test_tune_heap_leaves_a_process_that_chose_its_malloc_settings(env):
    got = _heap_probe(**env)
    assert got == {"tuned": False, "again": False, "mapped": 1}
