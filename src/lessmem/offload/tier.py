"""The tier interface every store implements, its statistics and its errors.

A tier maps string keys to *blocks* (``dict[str, Tensor | QTensor]``) within a byte
``capacity`` (None = unbounded) and evicts least-recently-used blocks to make room,
handing each evicted block to ``on_evict(key, block)`` first (the stack uses that to
demote it to the next tier). A block leaves a tier only after ``on_evict`` returned:
when it raises :class:`TierFullError` or :class:`TierUnavailableError` (no lower tier
took the block) the block stays where it is, over capacity, counted in
``stats.demote_failures`` with one warning per tier. A tier without ``on_evict`` (the
last one) drops what it evicts. ``get`` returns None on a miss — and also when a block
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
import warnings
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


class TierFullError(ValueError):
    """A block cannot be stored: larger than the tier's capacity, or the disk is full."""


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
    demote_failures: int = 0  # evictions undone: no lower tier took the block, so it stayed
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
    """Base class: key checks, stats, a lock and the hand-down of evicted blocks."""

    kind = "tier"

    def __init__(self, name: str, capacity: int | None):
        self.name = name
        self.capacity = check_capacity(capacity)
        self.stats = TierStats()
        self.on_evict: Callable[[str, dict], None] | None = None
        self._lock = threading.RLock()
        self._warned_demotion = False

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

    def close(self) -> None:  # noqa: B027 (a hook: most tiers hold nothing open)
        """Release what the tier holds open (files, connections); the default has nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else f"{self.capacity} B"
        return f"{type(self).__name__}({self.name!r}, {self.nbytes} B of {cap})"

    # -- helpers for subclasses -----------------------------------------------------
    def _victims(self, order: Iterable[tuple[str, int]], used: int, need: int) -> list[str]:
        """Keys to evict, least recently used first, so that ``used + need <= capacity``.

        ``order`` yields ``(key, bytes)`` least recently used first; it is read only as far
        as needed (pass a generator: eviction then costs O(evicted), not O(blocks held))."""
        if self.capacity is None:
            return []
        if need > self.capacity:
            raise TierFullError(
                f"block of {need} bytes is larger than the {self.name} tier's capacity {self.capacity}")
        out, free = [], self.capacity - used
        for k, n in order:
            if free >= need:
                break
            out.append(k)
            free += n
        return out

    def _hand_down(self, key: str, block: dict | None) -> bool:
        """Give an evicted block to ``on_evict``; True when the block may leave this tier.

        False (the block must stay) when ``on_evict`` raised TierFullError or
        TierUnavailableError: no lower tier took it. Counted in ``stats.demote_failures``;
        the first time, one RuntimeWarning names the tier and the reason."""
        if self.on_evict is None or block is None:
            return True
        try:
            self.on_evict(key, block)
            return True
        except (TierFullError, TierUnavailableError) as e:
            self.stats.demote_failures += 1
            if not self._warned_demotion:
                self._warned_demotion = True
                warnings.warn(f"{self.name} tier keeps block {key!r} over its capacity: no lower tier "
                              f"could take it ({e}); further failed demotions are only counted "
                              "(stats demote_failures)", RuntimeWarning, stacklevel=3)
            return False

    def _timed(self, read: bool, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        if read:
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += dt
        else:
            self.stats.bytes_written += nbytes
            self.stats.write_seconds += dt
