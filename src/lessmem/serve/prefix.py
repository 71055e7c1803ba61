"""Prefix sharing for the serving engine: the state after a prompt prefix, reused.

Whenever a request's prompt has been computed up to a chunk boundary ``p`` (a multiple of
the engine's ``chunk_tokens``), the engine registers a snapshot of its cache there
(:meth:`PrefixCache.register`): the pages are referenced, not copied, and the small
full-precision window is kept as it was. A later request whose prompt starts with the same
``p`` tokens (matched by the chained hash of its chunks, the model's fingerprint and the
cache config: :func:`lessmem.offload.prefix_hashes`) starts from that snapshot and
computes only the rest (:meth:`PrefixCache.lookup`). Because prompts are always computed in
the same aligned chunks, a request that starts from a snapshot is in exactly the state it
would have reached computing its prefix itself: outputs are identical with and without the
hit.

Snapshots live in the free part of the device budget: the least recently used go first
when requests need the room (:meth:`PrefixCache.evict`). With a persistent lower tier
(a disk directory or Redis) every snapshot is also written there — its pages under
content keys (one copy however many snapshots share them) and a record of its
full-precision parts — so a restarted server, or another server process sharing the
Redis store, finds it again (:meth:`PrefixCache.lookup` falls back to the tier).
This is automatic prefix caching as in vLLM and SGLang's RadixAttention (Zheng et al.,
2024, "SGLang: Efficient Execution of Structured Language Model Programs"), at chunk
granularity.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from ..kvcache.tiered.blocks import tensor_bytes
from ..offload import TierFullError, TierUnavailableError, layer_key, prefix_hashes
from .paged import PagedKVCache, release_snapshot


def _state_fp_bytes(states: list[dict]) -> int:
    """Full-precision bytes snapshots hold (a window is the snapshot's own copy,
    ``PagedKVLayer.snapshot``, or a tier's read: its bytes are its tensors')."""
    n = 0
    for s in states:
        for name in ("sinks", "window"):
            if s[name] is not None:
                n += tensor_bytes(s[name][0]) + tensor_bytes(s[name][1])
        n += tensor_bytes(s["keys"]) + tensor_bytes(s["values"])
    return n


class PrefixCache:
    """Snapshots of prompt prefixes at chunk boundaries (module doc).

    ``persist``: a lower tier (disk or Redis) that keeps them across restarts, or None."""

    def __init__(self, pool, model_id: str, key_config: dict, chunk: int, block_size: int,
                 sinks: int, persist=None):
        self.pool, self.model_id, self.key_config = pool, model_id, key_config
        self.chunk, self.block_size, self.sinks = chunk, block_size, sinks
        self.persist = persist
        self.entries: OrderedDict[str, tuple[int, list[dict], int]] = OrderedDict()
        self.fp_bytes = 0
        self.queries = self.hits = self.tokens_reused = 0  # counted by the engine, per request
        self.persisted = self.tier_hits = 0
        self._warned = False

    # ---- keys -------------------------------------------------------------------------
    def chunk_hashes(self, prompt: list[int]) -> list[str]:
        """The chained hash of every whole chunk of ``prompt`` (hash i: tokens 0..(i+1)·chunk)."""
        return prefix_hashes(prompt, self.chunk, self.model_id, self.key_config)

    def _page_keys(self, prefix: list[int], layer: int, n_pages: int) -> list[str]:
        hs = prefix_hashes(prefix, self.block_size, self.model_id, self.key_config,
                           first_block=self.sinks)
        hs = hs[1:] if self.sinks else hs
        return [layer_key(h, layer) for h in hs[:n_pages]]

    # ---- in-process snapshots ---------------------------------------------------------
    def register(self, prompt: list[int], p: int, cache: PagedKVCache) -> None:
        """Keep the state of ``cache`` after the first ``p`` prompt tokens (p a multiple of the chunk)."""
        h = self.chunk_hashes(prompt[:p])[-1]
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        states = cache.snapshot()
        nb = _state_fp_bytes(states)
        self.entries[h] = (p, states, nb)
        self.fp_bytes += nb
        if self.persist is not None:
            self._write(h, prompt[:p], states)

    def lookup(self, prompt: list[int], hashes: list[str] | None = None, beyond: int = 0,
               tier: bool = True) -> tuple[int, list[dict] | None]:
        """(p, snapshot) of the longest registered prefix of ``prompt`` longer than
        ``beyond`` tokens that leaves at least one token to compute, or (0, None);
        ``hashes``: the prompt's :meth:`chunk_hashes` if known; ``tier``: also ask the
        persistent tier. The states are the caller's to load (the cache takes its own
        references; the entry keeps its own)."""
        hs = hashes if hashes is not None else self.chunk_hashes(prompt)
        for i in range(len(hs) - 1, -1, -1):
            p = (i + 1) * self.chunk
            if p <= beyond:
                break
            if p >= len(prompt):
                continue
            entry = self.entries.get(hs[i])
            if entry is not None:
                self.entries.move_to_end(hs[i])
                return p, entry[1]
            if tier and self.persist is not None:
                states = self._read(hs[i], prompt[:p])
                if states is not None:
                    self.tier_hits += 1
                    nb = _state_fp_bytes(states)
                    self.entries[hs[i]] = (p, states, nb)
                    self.fp_bytes += nb
                    return p, states
        return 0, None

    def peek(self, prompt: list[int], hashes: list[str]) -> tuple[int, str | None]:
        """(p, key) of the longest snapshot held in this process for ``prompt`` (no tier
        read, nothing counted), or (0, None)."""
        for i in range(len(hashes) - 1, -1, -1):
            if (i + 1) * self.chunk < len(prompt) and hashes[i] in self.entries:
                return (i + 1) * self.chunk, hashes[i]
        return 0, None

    def freeable(self, protect=()) -> int:
        """Device bytes evicting every snapshot but ``protect`` would free (pages held by
        nothing else, and the snapshots' full-precision parts)."""
        n = 0
        for h, (_, states, nb) in self.entries.items():
            if h not in protect:
                n += nb + sum(p.nbytes for s in states for p in s["pages"] if p.refs == 1 and p.on_device)
        return n

    def evict(self, protect=()) -> bool:
        """Drop the least recently used snapshot not in ``protect``; False when there is none."""
        victim = next((h for h in self.entries if h not in protect), None)
        if victim is None:
            return False
        _, states, nb = self.entries.pop(victim)
        self.fp_bytes -= nb
        release_snapshot(self.pool, states)
        return True

    def clear(self) -> None:
        while self.evict():
            pass

    # ---- the persistent tier ------------------------------------------------------------
    def _warn(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"prefix cache: the persistent tier failed ({e}); prefixes are kept in "
                          "this process only until it answers again", RuntimeWarning, stacklevel=3)

    def _write(self, h: str, prefix: list[int], states: list[dict]) -> None:
        record = {}
        try:
            for li, s in enumerate(states):
                pages = s["pages"]
                for key, page in zip(self._page_keys(prefix, li, len(pages)), pages, strict=True):
                    if not page.on_device:
                        return  # demoted meanwhile: not worth a read back to persist
                    if not self.persist.contains(key):
                        self.persist.put(key, page.parts)
                for name in ("sinks", "window"):
                    if s[name] is not None:
                        record[f"L{li}.{name}.k"], record[f"L{li}.{name}.v"] = s[name]
                for name in ("keys", "values"):
                    if s[name] is not None:
                        record[f"L{li}.{name}"] = s[name]
                record[f"L{li}.n"] = torch.tensor([s["n_history"], s["length"], len(pages)])
            self.persist.put("snap-" + h, record)
            self.persisted += 1
        except (TierFullError, TierUnavailableError, OSError) as e:
            self._warn(e)

    def _read(self, h: str, prefix: list[int]):
        try:
            record = self.persist.get("snap-" + h)
            if record is None:
                return None
            states, taken = [], []
            li = 0
            while f"L{li}.n" in record:
                n_history, length, n_pages = (int(x) for x in record[f"L{li}.n"].tolist())
                pages = []
                for key in self._page_keys(prefix, li, n_pages):
                    block = self.persist.get(key)
                    if block is None:
                        for p in taken:
                            self.pool.unref(p)
                        return None
                    page = self.pool.ref(self.pool.add(block))
                    pages.append(page)
                    taken.append(page)
                s = {"n_history": n_history, "length": length, "pages": pages}
                for name in ("sinks", "window"):
                    k = record.get(f"L{li}.{name}.k")
                    s[name] = None if k is None else (k, record[f"L{li}.{name}.v"])
                for name in ("keys", "values"):
                    s[name] = record.get(f"L{li}.{name}")
                states.append(s)
                li += 1
            return states or None
        except (TierUnavailableError, OSError, ValueError) as e:
            self._warn(e)
            return None
