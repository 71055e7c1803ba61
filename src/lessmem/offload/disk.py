"""``DiskTier``: blocks as checksummed files in a directory that survives restarts.

Layout: ``<path>/blocks/<key>.blk``, each file one :func:`pack_block` blob (header with
length and CRC-32). A put writes ``<path>/blocks/.tmp.<pid>.<n>``, fsyncs it,
renames it over the final name and fsyncs the directory, so a reader (this process, a
peer, or a later one after ``kill -9``) sees either the whole block or no block. The
directory *is* the index: opening a store scans it (oldest mtime = least recently
used) and removes temp files left by dead writers. A block that is missing, truncated
or fails its checksum is reported as a miss with a warning (``stats.corrupt``) and moved
aside to ``<key>.blk.corrupt`` — never returned as data. A full disk (``ENOSPC``) or a
block over ``capacity`` raises :class:`TierFullError` after removing the temp file; no
partial block becomes visible. ``get_many`` reads a batch of blocks this store has seen in
one GIL-free call (:mod:`lessmem.offload.fastread`, same checks) — what a tiered cache
does for each layer at every decoding step; ``advise_async`` asks the OS, from a native
thread, to bring blocks into the page cache ahead of such reads (a prefetch hint).

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
import itertools
import os
import time
import warnings
from collections import OrderedDict
from pathlib import Path

from . import fastread
from .serialize import (
    HEADER_BYTES,
    CorruptBlockError,
    _parse_header,
    pack_block,
    read_header,
    unpack_block,
)
from .tier import Tier, TierFullError, check_key

_counter = itertools.count()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(Tier):
    """A directory of checksummed block files; LRU within ``capacity`` bytes."""

    kind = "disk"

    def __init__(self, path, capacity: int | None = None, fsync: bool = True, name: str = "disk"):
        super().__init__(name, capacity)
        self.path = Path(path)
        self.fsync = bool(fsync)
        self.dir = self.path / "blocks"
        self._dirname = str(self.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk tier path {str(path)!r} is not a usable directory: {e}") from e
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._headers: dict[str, tuple] = {}  # key -> (path, header, file bytes, parts) seen: get_many
        self._held = 0
        self._recent: set[str] = set()  # keys read since the last advise_async
        self._scan()

    # -- index ------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for f in self.dir.iterdir():
            name = f.name
            if name.startswith(".tmp."):
                pid = name.split(".")[2]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    f.unlink(missing_ok=True)  # left by a writer that died mid-write
                continue
            if name.endswith(".blk"):
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, name[:-4], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._held += size

    def _file(self, key: str) -> str:
        """The block's path (a str: built per block per decoding step, Path is slower)."""
        return os.path.join(self._dirname, key + ".blk")

    def _forget(self, key: str) -> None:
        self._headers.pop(key, None)
        self._recent.discard(key)  # (so it stays within the index)
        size = self._index.pop(key, None)
        if size is not None:
            self._held -= size

    # -- interface --------------------------------------------------------------------
    def put(self, key: str, block: dict) -> None:
        check_key(key)
        blob = pack_block(block, meta={"key": key})
        n = len(blob)
        t0 = time.perf_counter()
        with self._lock:
            old = self._index.get(key, 0)
            order = [(k, s) for k, s in self._index.items() if k != key]
            victims = self._victims(order, self._held - old, n)
            for k in victims:
                self._evict(k)
        tmp = self.dir / f".tmp.{os.getpid()}.{next(_counter)}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self._file(key))
            if self.fsync:
                self._fsync_dir()
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{self.name} tier at {self.path} is full (no space left "
                                    f"for a {n}-byte block); nothing was written") from e
            raise
        with self._lock:
            self._forget(key)
            self._index[key] = n
            self._held += n
            self._remember(key, blob)
            self.stats.puts += 1
            self._timed(False, n, t0)

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _evict(self, key: str) -> None:
        block = self._read(key) if self.on_evict is not None else None
        _unlink(self._file(key))
        self._forget(key)
        self.stats.evictions += 1
        if block is not None:
            self.on_evict(key, block)

    def _read(self, key: str) -> dict | None:
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                blob = bytearray(size)  # read straight into the buffer the tensors will view
                got = os.readv(fd, [blob])
                if got != size:
                    del blob[got:]
            finally:
                os.close(fd)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        try:
            block, meta = unpack_block(blob)
            if meta.get("key") != key:
                raise CorruptBlockError(f"file holds key {meta.get('key')!r}")
        except CorruptBlockError as e:
            warnings.warn(f"{self.name} tier: block {key!r} at {path} is corrupt ({e}); "
                          "treating it as a miss", RuntimeWarning, stacklevel=3)
            with self._lock:
                self.stats.corrupt += 1
                self._forget(key)
                try:
                    os.replace(path, path + ".corrupt")
                except OSError:
                    pass
            return None
        with self._lock:
            self._remember(key, blob)
            self._recent.add(key)
            self.stats.bytes_read += len(blob)
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by a peer process after we scanned
                self._index[key] = len(blob)
                self._held += len(blob)
        return block

    def _remember(self, key: str, blob) -> None:
        """Keep a verified block's header (and its tensor table) for ``get_many``."""
        hlen, plen, _ = read_header(memoryview(blob)[:HEADER_BYTES])
        header = bytes(memoryview(blob)[HEADER_BYTES:HEADER_BYTES + hlen])
        table, qdesc, _ = _parse_header(header, plen)
        if not qdesc:  # plain tensors only; QTensor blocks take the Python path
            self._headers[key] = (self._file(key), header, len(blob), fastread.kernel_parts(table))

    def get_many(self, keys: list[str], threads: int = 1) -> list[dict | None]:
        """``[get(k) for k in keys]``, in one GIL-free batch for the blocks this store has
        read or written before (:mod:`lessmem.offload.fastread`, ``threads`` files at a
        time); the others, and any that fail a check there, go through ``get`` (which
        reports corruption). The batched blocks of one call are views of one reused buffer:
        holding any of them keeps that whole buffer; ``clone()`` a block to keep it long."""
        with self._lock:  # (keys it holds were checked when stored; get checks the others)
            known = [(i, k, self._headers[k]) for i, k in enumerate(keys)
                     if isinstance(k, str) and k in self._headers]
        out: list[dict | None] = [None] * len(keys)
        done = set()
        if known and fastread.available():
            t0 = time.perf_counter()
            got = fastread.read_blocks(*zip(*(e for _, _, e in known), strict=True), threads=threads)
            n_bytes = 0
            with self._lock:
                for (i, k, e), block in zip(known, got, strict=True):
                    if block is None:
                        continue
                    out[i] = block
                    done.add(i)
                    n_bytes += e[2]
                    self._recent.add(k)
                    if k in self._index:
                        self._index.move_to_end(k)
                self.stats.hits += len(done)
                self.stats.bytes_read += n_bytes
                self.stats.read_seconds += time.perf_counter() - t0
        for i, k in enumerate(keys):
            if i not in done:
                out[i] = self.get(k)
        return out

    def advise(self, keys: list[str]) -> int:
        """Prefetch hint: ask the OS to read these blocks' files into the page cache in the
        background (``posix_fadvise(WILLNEED)``); nothing is returned or checked here.
        Returns how many files were found."""
        paths = self._paths(keys)
        if fastread.available():
            return fastread.advise(paths)
        n = 0
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                n += 1
            finally:
                os.close(fd)
        return n

    def _paths(self, keys: list[str]) -> list[str]:
        with self._lock:
            return [self._file(k) for k in keys if k in self._index]

    def advise_async(self, keys: list[str]) -> int | None:
        """``advise`` done by a native background thread (no Python thread, no GIL) for the
        blocks not read since the previous ``advise_async`` (those just read are in the page
        cache: advising them again costs a page-cache walk for nothing); returns a ticket
        for :meth:`advise_done`, or None where the compiled reader is missing (then nothing
        is done)."""
        if not fastread.available():
            return None
        with self._lock:
            recent, self._recent = self._recent, set()
            paths = [self._file(k) for k in keys if k in self._index and k not in recent]
        return fastread.advise_async(paths)

    @staticmethod
    def advise_done(ticket: int, wait: bool = False) -> bool:
        """Whether the hint with this ticket was carried out (``wait``: block until it is)."""
        return fastread.advise_done(ticket, wait)

    def get(self, key: str) -> dict | None:
        check_key(key)
        t0 = time.perf_counter()
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
        with self._lock:
            existed = os.path.exists(self._file(key))
            _unlink(self._file(key))
            self._forget(key)
            self._pinned.discard(key)
            if existed:
                self.stats.deletes += 1
            return existed

    def contains(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            if key in self._index:
                return True
        return os.path.exists(self._file(key))

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    @property
    def nbytes(self) -> int:
        return self._held
