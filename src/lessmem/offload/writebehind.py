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
The writer takes everything queued at once and hands it to the store's ``put_many`` (for
the disk tier: one lock and one directory fsync for the whole batch — a group commit), so
a burst of demotions costs about one fsync per block plus one, not two per block.

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
from collections import deque
from concurrent.futures import Future
from typing import Callable


class WriteBehind:
    """One background writer in front of ``put_many(items) -> [error or None, ...]``; each
    batch is what was queued when the writer got to it (one group commit)."""

    def __init__(self, put_many: Callable[[list], list], name: str, max_pending: int = 32):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r} must be a positive int")
        self._put_many, self._name = put_many, name
        self._room = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Condition()
        self._queue: deque[tuple[str, dict, Future]] = deque()
        self._pending: dict[str, tuple[dict, Future]] = {}
        self._thread: threading.Thread | None = None

    def submit(self, key: str, block: dict) -> Future:
        self._room.acquire()
        fut: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"lessmem-{self._name}-write",
                                                daemon=True)
                self._thread.start()
            self._queue.append((key, block, fut))
            self._pending[key] = (block, fut)
            self._lock.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if not self._lock.wait(timeout=5.0) and not self._queue:
                        self._thread = None  # idle: a later submit starts a new writer
                        return
                batch = list(self._queue)
                self._queue.clear()
            try:
                errors = self._put_many([(k, b) for k, b, _ in batch])
            except BaseException as e:  # noqa: BLE001 - every write of the batch failed
                errors = [e] * len(batch)
            with self._lock:
                for key, block, _ in batch:
                    entry = self._pending.get(key)
                    if entry is not None and entry[0] is block:  # not replaced by a newer submit
                        del self._pending[key]
            for (_, _, fut), err in zip(batch, errors, strict=True):
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)
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
        """Wait until everything submitted so far is written or failed (each future
        carries its own error; nothing is raised here)."""
        with self._lock:
            futures = [f for _, _, f in self._queue] + [f for _, f in self._pending.values()]
        for f in futures:
            f.exception()

    def close(self) -> None:
        self.flush()
