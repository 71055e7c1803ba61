"""How many of this process's cores other work leaves free (Linux ``/proc/stat``).

Fork-join parallel code (torch's intra-op threads, OpenMP) collapses when it has more
threads than free cores: each parallel region ends at a barrier, and a thread the
scheduler has parked behind another process makes every region wait a whole time slice.
Measured here (``benchmarks/results/bench_contention.json``): a 2-thread decode beside
one busy process ran at 0.08x its speed alone, a 1-thread one at 0.98x. :func:`free_cores` samples
the machine's idle time over a short interval so a caller can use no more threads than
there are idle cores.

Example:
    >>> 1 <= free_cores(0.01) <= usable_cores()
    True
"""

from __future__ import annotations

import functools
import os
import time


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return values[3] + values[4], sum(values)


def idle_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The machine's idle share between two ``(idle, total)`` samples (1.0: nothing ran)."""
    idle, total = after[0] - before[0], after[1] - before[1]
    return 1.0 if total <= 0 else min(1.0, max(0.0, idle / total))


def free_cores(sample_s: float = 0.1) -> int:
    """Usable cores left idle by other work over ``sample_s`` seconds (at least 1; all of
    them where the machine's idle time cannot be read)."""
    cores = usable_cores()
    first = _cpu_times()
    if first is None:
        return cores
    time.sleep(sample_s)
    second = _cpu_times()
    if second is None:
        return cores
    machine = os.cpu_count() or cores
    busy = machine * (1.0 - idle_share(first, second))  # cores' worth of other work
    return max(1, min(cores, int(machine - busy + 0.35)))  # a core counts free at >= 65% idle


# glibc's malloc thresholds lessmem sets for a model run (tune_heap): allocations up to
# HEAP_MMAP_THRESHOLD come from the heap (32 MiB: the ceiling glibc's own dynamic threshold
# climbs to, and the largest its manual allows on 64-bit systems), and the heap's free top
# goes back to the OS only past HEAP_TRIM_THRESHOLD (a 512-token chunk's layer frees less;
# 128 MiB made no prefill faster, and DynamicCache's 512-token peak RSS ~7 MiB higher)
HEAP_MMAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def tune_heap() -> bool:
    """Let glibc's heap keep the pages a model run frees and reuses (``mallopt``: the mmap
    threshold fixed at ``HEAP_MMAP_THRESHOLD``, the trim threshold at ``HEAP_TRIM_THRESHOLD``),
    once per process; True where they were set.

    By default glibc moves its mmap threshold as blocks come and go and hands the heap's free
    top back to the OS at twice that, so a prefill chunk's activations (a few MiB each, freed
    and allocated again in every layer) came as fresh pages over and over: a 2048-token
    prefill of the built-in model in 512-token chunks took ~400,000 page faults and 0.8 s of
    system time, ~120,000 and 0.3 s tuned (probes; the rest: ``trim_heap``'s explicit trims,
    which keep the peak RSS where it was). Process-wide, so it is skipped where the process already chose:
    ``MALLOC_*_`` thresholds or ``glibc.malloc`` tunables in the environment, or
    ``LESSMEM_TUNE_HEAP=0``; a no-op (False) without glibc's ``mallopt`` (musl, macOS,
    Windows). With another allocator preloaded (jemalloc, tcmalloc) it tunes glibc's, which
    that one stands in for: nothing changes.
    """
    env = os.environ
    chosen = (env.get("LESSMEM_TUNE_HEAP", "1").strip().lower() in ("0", "false", "no", "off")
              or any(k in env for k in _USER_MALLOC_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""))
    fn = None if chosen else _libc_function("mallopt", ("c_int", "c_int"))
    return fn is not None and bool(fn(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
        fn(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))


@functools.cache
def _libc_function(name: str, argtypes: tuple[str, ...]):
    """The C library's function ``name`` (ctypes, returning int; ``argtypes`` by ctypes type
    name), or None where the library or the function is missing; looked up once."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.util.find_library("c")
        fn = getattr(ctypes.CDLL(lib), name, None) if lib else None
    except OSError:
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [getattr(ctypes, t) for t in argtypes], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``);
    False where the C library has none (musl, macOS, Windows).

    A prefill frees its activations, but the allocator keeps the freed pages, so the
    process's RSS while it decodes still counts them (measured on the built-in model after a
    512-token prefill: 17-27 MiB, more than the KV cache of best-4). Called after each
    prefill chunk of a switched model and after its decode steps that move blocks into a
    lessmem cache's history (``lessmem.decode``), every ``TRIM_EVERY_LAYERS`` layers of a long
    prefill chunk (``kvcache.layer``) and after a load (``lessmem.load``)."""
    fn = _libc_function("malloc_trim", ("c_size_t",))
    if fn is None:
        return False
    fn(0)
    return True
