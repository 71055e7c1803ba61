"""The tier interface every store implements, its statistics and its errors.

A tier maps string keys to *blocks* (``dict[str, Tensor | QTensor]``) within a byte
``capacity`` (None = unbounded) and evicts least-recently-used unpinned blocks to make
room, handing each evicted block to ``on_evict(key, block)`` (the stack uses that to
demote it to the next tier). ``get`` returns None on a miss — and also when a block
fails verification: a corrupted block is counted (``stats.corrupt``), warned about and
never returned.

Example:
    >>> import torch
    >>> from lessmem.offload import HostTier
    >>> t = HostTier(capacity=1024)
    >>> t.put("a", {"x": torch.zeros(64)})        # 256 bytes
    >>> t.contains("a"), t.nbytes, t.get("b")
    (True, 256, None)
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


class TierFullError(ValueError):
    """A block cannot be stored: larger than the tier, everything else pinned, or disk full."""


class TierUnavailableError(RuntimeError):
    """The tier cannot be reached or refused the operation (Redis down, error reply).

    A ``put`` that raises this has stored nothing: the caller keeps the block. A ``get``
    from an unavailable tier is a miss, never this error (the cache recomputes).
    """


def check_key(key) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"block key {key!r} is invalid; allowed: 1-200 chars of [A-Za-z0-9_.:-]")
    return key


def check_capacity(capacity) -> int | None:
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity={capacity!r} must be a non-negative int (bytes) or None")
    return capacity


@dataclass
class TierStats:
    """Counters of one tier; ``read_gbps``/``write_gbps`` are achieved bandwidths."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    corrupt: int = 0  # blocks that failed verification (reported as misses)
    errors: int = 0  # failed operations (e.g. remote store unreachable)
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "read_gbps": self.read_gbps, "write_gbps": self.write_gbps}


class Tier(ABC):
    """Base class: key checks, pins, stats, a lock and ``get_async`` on a small pool."""

    kind = "tier"

    def __init__(self, name: str, capacity: int | None):
        self.name = name
        self.capacity = check_capacity(capacity)
        self.stats = TierStats()
        self.on_evict: Callable[[str, dict], None] | None = None
        self._pinned: set[str] = set()
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None

    # -- the interface --------------------------------------------------------------
    @abstractmethod
    def put(self, key: str, block: dict) -> None:
        """Store ``block`` under ``key`` (replacing any previous one)."""

    @abstractmethod
    def get(self, key: str) -> dict | None:
        """The block, or None on a miss (or a block that failed verification)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> list[str]:
        """Keys held, least recently used first."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this tier holds now (as stored: tensors in RAM, files on disk)."""

    def get_async(self, key: str) -> Future:
        """``get`` on a background thread; the future's result is the block or None."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix=f"lessmem-{self.name}")
        return self._pool.submit(self.get, key)

    def get_many(self, keys: list[str], threads: int = 1) -> list[dict | None]:
        """``[get(k) for k in keys]``; a tier that can read a batch faster overrides it
        (``threads``: how many cores it may use)."""
        return [self.get(k) for k in keys]

    def advise_async(self, keys: list[str]) -> int | None:
        """Prefetch hint: start bringing these blocks closer in the background; returns a
        ticket for ``advise_done``, or None when this tier has nothing to do (the default)."""
        return None

    def advise_done(self, ticket: int, wait: bool = False) -> bool:
        """Whether the hint with this ticket was carried out (``wait``: block until it is)."""
        return True

    def pin(self, key: str) -> None:
        """Never evict ``key`` (sinks, window) until ``unpin``."""
        with self._lock:
            self._pinned.add(check_key(key))

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pinned.discard(key)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else f"{self.capacity} B"
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} B of {cap})"

    # -- helpers for subclasses -----------------------------------------------------
    def _victims(self, order: list[tuple[str, int]], used: int, need: int) -> list[str]:
        """LRU-first unpinned keys to drop so that ``used + need <= capacity``."""
        if self.capacity is None:
            return []
        if need > self.capacity:
            raise TierFullError(
                f"block of {need} bytes is larger than the {self.name} tier's capacity {self.capacity}")
        out, free = [], self.capacity - used
        for k, n in order:
            if free >= need:
                break
            if k not in self._pinned:
                out.append(k)
                free += n
        if free < need:
            raise TierFullError(
                f"{self.name} tier is full: {used} of {self.capacity} bytes held, "
                f"{need} needed, the rest is pinned")
        return out

    def _timed(self, read: bool, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        if read:
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += dt
        else:
            self.stats.bytes_written += nbytes
            self.stats.write_seconds += dt
