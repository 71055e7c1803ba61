"""Reading ahead: the prefetcher of a tiered cache, its thread, its work in flight.

Two ways, chosen by ``prefetch=``:

- ``"gather"``: while layer i computes, a background thread gathers layer i+1 (reads,
  checks and stages its blocks; after the last layer: layer 0 for the next step). It
  hides the whole read when a core is free for it, and a remote tier's network wait
  always.
- ``"hint"``: once a step, each lower tier that can (the disk tier's native thread) is
  asked to bring every block the step will read closer (``posix_fadvise(WILLNEED)``:
  hides the disk's latency and costs the decoding thread neither a Python thread nor
  the GIL); the decoding thread then reads and checks each layer's blocks itself.
- ``True`` / ``"auto"`` picks "gather" when the process has a core that torch's threads
  leave free, a tier is remote, or the device is a GPU (the copies up run on a side CUDA
  stream while the previous layer computes: ``staging``), else "hint" (with every core computing, a background
  copy and checksum only take time from the model: on 2 cores, no gain, a few % lost).
- ``False`` / ``None``: no reading ahead.

``stats`` counts what was issued and whether it was ready when needed (``on_time``) or
the consumer waited (``late``, ``late_seconds``): the prefetch lateness.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from ...base.cpu import usable_cores

PREFETCH_CHOICES = (True, False, None, "auto", "gather", "hint")


@dataclass
class PrefetchStats:
    issued: int = 0
    on_time: int = 0  # ready when the consumer asked
    late: int = 0  # the consumer had to wait
    late_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class PrefetchHandle:
    """One gather in flight: ``result()`` waits if needed and records lateness once.
    ``tag`` says what the gather read (stale when the layer changed since), ``nbytes``
    what it will hold on the device."""

    def __init__(self, future: Future, stats: PrefetchStats, lock: threading.Lock, tag=None,
                 nbytes: int = 0):
        self.future, self.tag, self.nbytes = future, tag, nbytes
        self._stats, self._lock, self._done = stats, lock, False

    def result(self):
        if self._done:
            return self.future.result()
        ready = self.future.done()
        t0 = time.perf_counter()
        out = self.future.result()
        with self._lock:
            if ready:
                self._stats.on_time += 1
            else:
                self._stats.late += 1
                self._stats.late_seconds += time.perf_counter() - t0
        self._done = True
        return out


def check_prefetch(prefetch) -> None:
    """ValueError unless ``prefetch`` is one of the choices in the module doc."""
    if not any(prefetch is c or (isinstance(c, str) and prefetch == c) for c in PREFETCH_CHOICES):
        raise ValueError(f"prefetch={prefetch!r}; allowed: True/'auto', 'gather', 'hint', False")


class Prefetcher:
    """Reads ahead for one cache (see the module doc). ``lower``: the tiers below the
    device (hints go to them; a remote one makes "auto" gather); ``device_type``: the
    device tier's ("cuda" makes "auto" gather)."""

    def __init__(self, prefetch, lower: list, device_type: str | None = None):
        check_prefetch(prefetch)
        self.requested = "auto" if prefetch is True else (prefetch or None)
        self.lower = lower
        self.device_type = device_type
        self.stats = PrefetchStats()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started on the first gather
        self._gathers: dict[int, PrefetchHandle] = {}  # by layer index
        self._hints: list[tuple] = []  # (tier, ticket) of the last step's hints

    @property
    def enabled(self) -> bool:
        """Whether reading ahead was asked for at all (the budget keeps room for it)."""
        return self.requested is not None

    @property
    def mode(self) -> str | None:
        """What it does now: "gather", "hint" or None."""
        if self.requested != "auto":
            return self.requested
        if (usable_cores() > torch.get_num_threads() or any(t.kind == "remote" for t in self.lower)
                or self.device_type == "cuda"):  # on CUDA the copy engine moves, the thread only issues
            return "gather"  # (asked at each read: the affinity and threads may change)
        return "hint"

    # ---- "gather" ------------------------------------------------------------------------
    def start(self, layer_idx: int, tag, nbytes: int, fn, *args) -> None:
        """Run ``fn(*args)`` on the background thread for layer ``layer_idx``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lessmem-kv-prefetch")
        with self._lock:
            self.stats.issued += 1
        self._gathers[layer_idx] = PrefetchHandle(self._pool.submit(fn, *args), self.stats, self._lock,
                                                  tag, nbytes)

    def take(self, layer_idx: int, tag):
        """The result gathered for layer ``layer_idx`` if one was started with this ``tag``
        (None: nothing started, or stale: the layer changed since)."""
        handle = self._gathers.pop(layer_idx, None)
        if handle is None:
            return None
        if handle.tag != tag:  # stale: the layer changed since; its failure (if any) is moot
            handle.future.exception()
            return None
        return handle.result()

    def in_flight_bytes(self) -> int:
        return sum(h.nbytes for h in self._gathers.values())

    # ---- "hint" --------------------------------------------------------------------------
    def hint(self, keys: list[str]) -> None:
        """Ask each lower tier that can (disk) to bring these blocks closer from its
        native thread. A hint not carried out by the next one counts as late. Without
        the compiled reader there is no native thread and no hint (a Python thread would
        take the GIL from decoding)."""
        with self._lock:
            for tier, ticket in self._hints:  # the previous step's: carried out in time?
                if tier.advise_done(ticket):
                    self.stats.on_time += 1
                else:
                    self.stats.late += 1
            self._hints = []
        for t in self.lower:
            ticket = t.advise_async(keys) if keys else None
            if ticket is not None:
                with self._lock:
                    self.stats.issued += 1
                    self._hints.append((t, ticket))

    # ---- lifecycle -----------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for everything in flight and forget it (block keys may change next)."""
        for h in self._gathers.values():
            h.future.exception()  # waits; the failure of a read nobody takes does not matter
        self._gathers = {}
        for tier, ticket in self._hints:
            tier.advise_done(ticket, wait=True)
        self._hints = []

    def close(self) -> None:
        """Drain and stop the thread."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
