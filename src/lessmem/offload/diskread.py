"""``BatchReads``: the batched, GIL-free reads and page-cache hints of a ``DiskTier``.

A mixin for :class:`~lessmem.offload.DiskTier` (kept apart so each class stays small).
It uses the tier's ``_lock``, ``_index`` (key -> bytes, LRU first), ``_headers`` (the
verified header of each block this process read or wrote), ``_recent`` (keys read since
the last hint), ``_file(key)``, ``stats`` and ``get`` (the checked path it falls back to).
"""

from __future__ import annotations

import os
import time

from . import fastread
from .serialize import HEADER_BYTES, _parse_header, read_header


class BatchReads:
    """``get_many`` through :mod:`lessmem.offload.fastread`; ``advise``/``advise_async``."""

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
            known = [(i, k, self._headers[k]) for i, k in enumerate(keys)  # a newer put_async
                     if isinstance(k, str) and k in self._headers                # still pending:
                     and self._behind.pending(k) is None]                       # get serves it
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

