"""``DiskTier``: blocks as checksummed files in a directory that survives restarts.

Layout and safety rules: :mod:`lessmem.offload.blockdir` (files 0600 in 0700 directories,
temp files created exclusively under random names outside the key namespace, a store
directory another user could tamper with is refused). Each file is one
:func:`pack_block` blob (header with length and CRC-32). A put writes a temp file,
fsyncs it, renames it over ``blocks/<key>.blk`` and fsyncs the directory, so a reader
(this process, a peer, or a later one after ``kill -9``) sees either the whole block or
no block; ``put`` returning means the block is durable. ``put_async`` does the same on a
background writer and acknowledges through its future (:mod:`lessmem.offload.writebehind`).

Several processes may share one directory: renames, evictions and deletes happen under a
file lock that also keeps the byte count of all blocks, so ``capacity`` bounds the whole
directory (temp files being written, one per writer, come on top). Each process evicts
its least recently used blocks first, then — after rescanning the directory — the oldest
written by others; a block a peer evicted reads as a miss, never an error. Blocks of
dead sessions (``s<id>-…`` keys of killed processes) are reclaimed.

A block that is missing, truncated or fails its checksum is reported as a miss with a
warning (``stats.corrupt``) and moved aside to ``<key>.blk.corrupt`` — never returned as
data. A full disk (``ENOSPC``) or a block over ``capacity`` raises :class:`TierFullError`
after removing the temp file; no partial block becomes visible. ``get_many`` reads a
batch of blocks this store has seen in one GIL-free call (:mod:`lessmem.offload.fastread`,
same checks); ``advise_async`` asks the OS, from a native thread, to bring blocks into the
page cache ahead of such reads (a prefetch hint).

Example:
    >>> import tempfile, torch
    >>> from lessmem.offload import DiskTier
    >>> d = tempfile.mkdtemp()
    >>> DiskTier(d).put("a", {"x": torch.arange(4)})
    >>> DiskTier(d).get("a")["x"].tolist()        # a reopened store serves what it held
    [0, 1, 2, 3]
"""

from __future__ import annotations

import errno
import os
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from .blockdir import TEMP_PREFIX, BlockDir, _unlink  # noqa: F401  (TEMP_PREFIX: for tests and tools)
from .diskread import BatchReads
from .serialize import CorruptBlockError, pack_block, unpack_block
from .tier import Tier, TierFullError, check_key
from .writebehind import WriteBehind


class DiskTier(BatchReads, Tier):
    """A directory of checksummed block files; LRU within ``capacity`` bytes."""

    kind = "disk"

    def __init__(self, path, capacity: int | None = None, fsync: bool = True, name: str = "disk",
                 max_pending: int = 32):
        super().__init__(name, capacity)
        self.store = BlockDir(path)
        self.path = Path(path)
        self.fsync = bool(fsync)
        self.dir = Path(self.store.blocks)
        self._dirname = self.store.blocks
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._headers: dict[str, tuple] = {}  # key -> (path, header, file bytes, parts) seen: get_many
        self._recent: set[str] = set()  # keys read since the last advise_async
        self._behind = WriteBehind(self.put_many, name, max_pending)
        with self.store.locked():
            self._rescan()

    # -- index ------------------------------------------------------------------------
    def _rescan(self) -> None:
        """(In the store lock.) Reclaim dead sessions; learn blocks this process has not
        seen, as older than any it has (they go first at the LRU end)."""
        blocks, gone = self.store.scan()
        for key in gone:
            self._forget(key)
        seen = list(self._index.items())
        self._index.clear()
        for _, key, size in blocks:
            self._index[key] = size
        present = set(self._index)
        for k, n in seen:  # what this process used keeps its order, after the others
            if k in present:
                self._index.pop(k)
                self._index[k] = n

    def _file(self, key: str) -> str:
        """The block's path (a str: built per block per decoding step, Path is slower)."""
        return os.path.join(self._dirname, key + ".blk")

    def _forget(self, key: str) -> None:
        self._headers.pop(key, None)
        self._recent.discard(key)  # (so it stays within the index)
        self._index.pop(key, None)

    # -- writing ----------------------------------------------------------------------
    def put(self, key: str, block: dict) -> None:
        """Store the block durably (fsynced, unless ``fsync=False``) before returning."""
        err = self.put_many([(key, block)])[0]
        if err is not None:
            raise err

    def put_many(self, items: list[tuple[str, dict]]) -> list[Exception | None]:
        """``put`` for each ``(key, block)``, sharing one store lock and one directory
        fsync (a group commit: what the write-behind queue does with what it has queued).
        Returns, per item, None (durable) or the exception its ``put`` would have raised."""
        out: list[Exception | None] = [None] * len(items)
        staged = []
        for i, (key, block) in enumerate(items):
            try:
                check_key(key)
                t0 = time.perf_counter()
                blob = pack_block(block, meta={"key": key})
                if self.capacity is not None and len(blob) > self.capacity:
                    raise TierFullError(f"block of {len(blob)} bytes is larger than the {self.name} "
                                        f"tier's capacity {self.capacity}")
                staged.append((i, key, blob, self._write_temp(blob), t0))
            except Exception as e:  # noqa: BLE001 - handed to the caller, per item
                out[i] = e
        try:
            with self.store.locked(), self._lock:
                for i, key, blob, tmp, _ in staged:
                    self._make_room(key, len(blob))
                    try:
                        self.store.commit(tmp, key, len(blob))
                    except OSError as e:
                        out[i] = e
                        continue
                    self._forget(key)
                    self._index[key] = len(blob)
                    self._remember(key, blob)
            if self.fsync and staged:
                self.store.fsync_dir()
        finally:
            for _, _, _, tmp, _ in staged:
                _unlink(tmp)  # (renamed ones are gone already)
        with self._lock:
            for i, _, blob, _, t0 in staged:
                if out[i] is None:
                    self.stats.puts += 1
                    self._timed(False, len(blob), t0)
        return out

    def _write_temp(self, blob: bytes) -> str:
        fd, tmp = self.store.temp()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{self.name} tier at {self.path} is full (no space left "
                                    f"for a {len(blob)}-byte block); nothing was written") from e
            raise
        return tmp

    def _make_room(self, key: str, n: int) -> None:
        """(In the store lock.) Evict LRU blocks until ``n`` more bytes fit under capacity.
        A block ``on_evict`` could not hand down stays (over capacity, see ``Tier``)."""
        if self.capacity is None:
            return
        store, rescanned, kept = self.store, False, set()
        if store.reclaim_due():
            self._rescan()
        old = store.size(key) or 0
        while store.used - old + n > self.capacity:
            victim = next((k for k in self._index if k != key and k not in kept), None)
            if victim is None:
                if rescanned:
                    return
                self._rescan()
                rescanned = True
                continue
            block = self._read(victim, locked=True) if self.on_evict is not None else None
            if not self._hand_down(victim, block):
                kept.add(victim)
                continue
            self._forget(victim)
            if store.remove(victim) is not None:
                self.stats.evictions += 1

    def put_async(self, key: str, block: dict) -> Future:
        """``put`` on a background writer (see :mod:`lessmem.offload.writebehind`): returns
        at once; the future completes only once the block is durable (or holds the error,
        e.g. ``TierFullError``). Until then ``get``/``contains`` see the pending block."""
        check_key(key)
        return self._behind.submit(key, block)

    def flush(self) -> None:
        """Wait until every ``put_async`` so far is durable (or failed)."""
        self._behind.flush()

    # -- reading ----------------------------------------------------------------------
    def _read(self, key: str, locked: bool = False) -> dict | None:
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                blob = bytearray(st.st_size)  # read straight into the buffer the tensors will view
                got = os.readv(fd, [blob])
                if got != st.st_size:
                    del blob[got:]
            finally:
                os.close(fd)
        except OSError as e:  # missing (also: evicted by a peer), or a symlink: a miss
            if not isinstance(e, FileNotFoundError):
                warnings.warn(f"{self.name} tier: block {key!r} at {path} cannot be read ({e}); "
                              "treating it as a miss", RuntimeWarning, stacklevel=3)
            with self._lock:
                self.stats.errors += not isinstance(e, FileNotFoundError)
                self._forget(key)
            return None
        try:
            block, meta = unpack_block(blob)
            if meta.get("key") != key:
                raise CorruptBlockError(f"file holds key {meta.get('key')!r}")
        except CorruptBlockError as e:
            warnings.warn(f"{self.name} tier: block {key!r} at {path} is corrupt ({e}); "
                          "treating it as a miss", RuntimeWarning, stacklevel=3)
            self._set_aside(key, st.st_ino, locked)
            return None
        with self._lock:
            self._remember(key, blob)
            self._recent.add(key)
            self.stats.bytes_read += len(blob)
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by a peer process after we scanned
                self._index[key] = len(blob)
        return block

    def _set_aside(self, key: str, ino: int, locked: bool) -> None:
        """Move a corrupt file to ``<key>.blk.corrupt`` (unless a peer replaced it since)."""
        if not locked:
            with self.store.locked():
                return self._set_aside(key, ino, True)
        with self._lock:
            self.stats.corrupt += 1
            self._forget(key)
            try:
                self.store.remove(key, ino=ino, aside=True)
            except OSError:
                pass

    def get(self, key: str) -> dict | None:
        check_key(key)
        t0 = time.perf_counter()
        block = self._behind.pending(key)
        if block is None:
            block = self._read(key)
        with self._lock:
            if block is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.read_seconds += time.perf_counter() - t0
        return block

    def delete(self, key: str) -> bool:
        check_key(key)
        self._behind.wait(key)
        with self.store.locked(), self._lock:
            existed = self.store.remove(key) is not None
            self._forget(key)
            if existed:
                self.stats.deletes += 1
            return existed

    def contains(self, key: str) -> bool:
        """Held now (a write still pending counts; a block a peer evicted does not)."""
        check_key(key)
        if self._behind.pending(key) is not None or os.path.exists(self._file(key)):
            return True
        with self._lock:
            self._forget(key)
        return False

    def keys(self) -> list[str]:
        """Keys this process knows the store holds, least recently used first."""
        with self._lock:
            return list(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes all blocks in the directory use (every process sharing it together)."""
        return self.store.usage()

    def close(self) -> None:
        """Finish pending writes, then leave the store (this process's sessions end)."""
        self._behind.close()
        super().close()
        self.store.close()


