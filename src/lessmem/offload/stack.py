"""``TierStack``: tiers in order (fastest first), placement, demotion and prefetch.

- ``put``: write-back puts into the first tier that takes the block and lets LRU
  eviction demote blocks one tier down (``on_evict``); write-through also writes every
  lower tier before returning (so a crash loses nothing that was put).
- ``get``: searches fastest to slowest; with ``promote`` a block found below is copied
  into the first tier (which may demote others).
- ``prefetch(key)`` starts a ``get`` on a background thread and returns a handle whose
  ``result()`` records whether the block arrived before it was needed (``on_time``) or
  how long the consumer waited (``late``, ``late_seconds``): the prefetch lateness.

Example:
    >>> import torch, tempfile
    >>> from lessmem.offload import TierStack, DeviceTier, DiskTier
    >>> s = TierStack([DeviceTier(300, device="cpu"), DiskTier(tempfile.mkdtemp())])
    >>> _ = s.put("a", {"x": torch.zeros(64)}); _ = s.put("b", {"x": torch.ones(64)})  # 256 B each
    >>> s.where("a"), s.where("b")                 # "a" was demoted to disk
    ('disk', 'device')
    >>> s.prefetch("a").result()["x"].sum().item()
    0.0
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from .tier import Tier, TierFullError

WRITE_POLICIES = ("write-back", "write-through")


@dataclass
class PrefetchStats:
    issued: int = 0
    on_time: int = 0  # result was ready when the consumer asked
    late: int = 0  # the consumer had to wait
    late_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class PrefetchHandle:
    """A prefetch in flight; ``result()`` blocks if needed and records lateness."""

    def __init__(self, future: Future, stats: PrefetchStats, lock: threading.Lock):
        self.future, self._stats, self._lock, self._done = future, stats, lock, False

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


class TierStack:
    """Ordered tiers (fastest first) behind one put/get/prefetch/delete interface."""

    def __init__(self, tiers: list[Tier], write_policy: str = "write-back", promote: bool = True,
                 workers: int = 2):
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(f"tiers={tiers!r} must be a non-empty list of Tier objects")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names {names} must be unique")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={write_policy!r}; allowed: {', '.join(WRITE_POLICIES)}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive int")
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.promote = bool(promote)
        self.prefetch_stats = PrefetchStats()
        self._plock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lessmem-prefetch")
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(i)

    def _demoter(self, i: int):
        def demote(key: str, block: dict) -> None:
            self._put_from(i + 1, key, block)
        return demote

    def _put_from(self, start: int, key: str, block: dict) -> str | None:
        """Put into the first tier at or below ``start`` that takes it (skip if held)."""
        for t in self.tiers[start:]:
            if t.contains(key):
                return t.name
            try:
                t.put(key, block)
                return t.name
            except TierFullError:
                continue
        return None

    def put(self, key: str, block: dict, start: int = 0) -> str:
        """Store ``block``; returns the name of the tier that took it first."""
        placed = None
        for i, t in enumerate(self.tiers[start:], start):
            try:
                t.put(key, block)
            except TierFullError:
                if i == len(self.tiers) - 1 and placed is None:
                    raise
                continue
            placed = placed or t.name
            if self.write_policy == "write-back":
                break
        if placed is None:
            raise TierFullError(f"no tier could take block {key!r}")
        return placed

    def get(self, key: str, promote: bool | None = None) -> dict | None:
        for i, t in enumerate(self.tiers):
            block = t.get(key)
            if block is not None:
                if i > 0 and (self.promote if promote is None else promote):
                    try:
                        self.tiers[0].put(key, block)
                    except TierFullError:
                        pass
                return block
        return None

    def prefetch(self, key: str, promote: bool | None = False) -> PrefetchHandle:
        """Start ``get(key)`` in the background (no promotion by default)."""
        with self._plock:
            self.prefetch_stats.issued += 1
        return PrefetchHandle(self._pool.submit(self.get, key, promote), self.prefetch_stats,
                              self._plock)

    get_async = prefetch

    def where(self, key: str) -> str | None:
        """Name of the fastest tier holding ``key`` (None if none)."""
        for t in self.tiers:
            if t.contains(key):
                return t.name
        return None

    def contains(self, key: str) -> bool:
        return self.where(key) is not None

    def delete(self, key: str) -> bool:
        return any([t.delete(key) for t in self.tiers])

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ValueError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    def placement(self) -> dict[str, int]:
        """Bytes held per tier."""
        return {t.name: t.nbytes for t in self.tiers}

    def stats(self) -> dict:
        out = {t.name: t.stats.to_dict() for t in self.tiers}
        out["prefetch"] = self.prefetch_stats.to_dict()
        return out

    def flush(self) -> None:
        """Write-back: copy every block held only in upper tiers one tier further down."""
        for i, t in enumerate(self.tiers[:-1]):
            for key in t.keys():
                block = t.get(key)
                if block is not None:
                    self._put_from(i + 1, key, block)

    def close(self, flush: bool = True) -> None:
        """Flush (write-back, unless ``flush=False``) and close every tier."""
        if flush and self.write_policy == "write-back":
            self.flush()
        self._pool.shutdown(wait=True)
        for t in self.tiers:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
