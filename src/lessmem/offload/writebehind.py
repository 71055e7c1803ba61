"""``WriteBehind``: durable writes moved off the caller's thread, acknowledged when durable.

``submit(key, block)`` hands the block to one background writer and returns a
:class:`~concurrent.futures.Future` at once; the future completes (result None) only
after the store's own ``put`` returned — for a :class:`~lessmem.offload.DiskTier`, after
the file and its directory were fsynced — or carries the error that ``put`` raised
(``TierFullError``, ``OSError``): "acknowledged means durable" is unchanged, it only
moves to the future. Until then the block is *pending*: ``pending(key)`` returns it, so
the store can serve reads of what it was asked to keep. At most ``max_pending`` blocks
wait; a further ``submit`` blocks its caller until one is written (backpressure, so
memory cannot grow without bound). ``flush()`` waits for every write submitted so far.

Example:
    >>> import tempfile, torch
    >>> from lessmem.offload import DiskTier
    >>> t = DiskTier(tempfile.mkdtemp())
    >>> fut = t.put_async("a", {"x": torch.arange(3)})
    >>> t.get("a")["x"].tolist()                  # served while the write is pending
    [0, 1, 2]
    >>> fut.result(), t.flush()                   # None, None: written and fsynced
    (None, None)
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class WriteBehind:
    """One background writer in front of ``put(key, block)``."""

    def __init__(self, put: Callable[[str, dict], None], name: str, max_pending: int = 32):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r} must be a positive int")
        self._put, self._name = put, name
        self._room = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[dict, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, key: str, block: dict) -> Future:
        self._room.acquire()
        try:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"lessmem-{self._name}-write")
                fut = self._pool.submit(self._write, key, block)
                self._pending[key] = (block, fut)
        except BaseException:
            self._room.release()
            raise
        return fut

    def _write(self, key: str, block: dict) -> None:
        try:
            self._put(key, block)
        finally:
            with self._lock:
                entry = self._pending.get(key)
                if entry is not None and entry[0] is block:  # not replaced by a newer submit
                    del self._pending[key]
            self._room.release()

    def pending(self, key: str) -> dict | None:
        """The block submitted under ``key`` and not yet written (None: nothing pending)."""
        with self._lock:
            entry = self._pending.get(key)
        return None if entry is None else entry[0]

    def wait(self, key: str) -> None:
        """Wait until the pending write of ``key`` (if any) is done (before a delete)."""
        with self._lock:
            entry = self._pending.get(key)
        if entry is not None:
            entry[1].exception()

    def flush(self) -> None:
        """Wait until everything submitted so far is written; re-raises nothing (each
        future carries its own error)."""
        with self._lock:
            futures = [f for _, f in self._pending.values()]
        for f in futures:
            f.exception()

    def close(self) -> None:
        self.flush()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
