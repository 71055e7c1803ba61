"""The sealed blocks of one tiered cache: their keys, where they are, how they come back.

A :class:`BlockStore` owns one cache's tiers (a :class:`~lessmem.offload.TierStack`
whose first tier is the device tier) and its keys: a block fully inside the token ids
declared with ``set_tokens`` is keyed by the chained hash of that prefix, the model id
and the cache config (another cache, process or machine sharing a tier finds it); any
other block gets a key private to this cache's session. ``put`` stores a block,
``gather`` reads a layer's blocks back in order (device-tier blocks by reference, the
rest in one batch per lower tier), ``fetch`` one block.

A :class:`SealedBlocks` is one layer's record of its sealed blocks (keys, bytes, bytes
per part), oldest first; the layer owns it, the store never changes it.
"""

from __future__ import annotations

import uuid
import warnings

import torch

from ...offload import (
    DeviceTier,
    Tier,
    TierFullError,
    TierStack,
    TierUnavailableError,
    block_nbytes,
    layer_key,
    prefix_hashes,
    sequence_hash,
)


class BlockLostError(RuntimeError):
    """A sealed block is in no tier any more (corrupted, deleted or evicted from the last
    tier); ``key`` names it (None when unknown)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def tensor_bytes(t) -> int:
    """Bytes of a tensor's elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


class SealedBlocks:
    """One layer's sealed blocks, oldest first: ``keys``, ``nbytes`` (per block) and
    ``part_bytes`` (bytes per history part, e.g. ``k_codes``, over all blocks)."""

    def __init__(self):
        self.keys: list[str] = []
        self.nbytes: list[int] = []
        self.part_bytes: dict[str, int] = {}
        self.total = 0  # sum(nbytes), kept as blocks come and go

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: str, block: dict, sign: int = 1) -> None:
        """Record ``block`` as the newest sealed block (``sign=-1``: take it back again)."""
        n = block_nbytes(block)
        if sign > 0:
            self.keys.append(key)
            self.nbytes.append(n)
        else:
            self.keys.pop()
            self.nbytes.pop()
        self.total += sign * n
        for name, t in block.items():
            self.part_bytes[name] = self.part_bytes.get(name, 0) + sign * tensor_bytes(t)

    def load(self, keys: list[str], nbytes: list[int], part_bytes: dict[str, int]) -> None:
        """Replace the record (a restored prefix)."""
        self.keys, self.nbytes, self.part_bytes = list(keys), list(nbytes), dict(part_bytes)
        self.total = sum(self.nbytes)

    def bytes_from(self, first: int) -> int:
        """Bytes of the blocks from index ``first`` on."""
        return self.total if first <= 0 else sum(self.nbytes[first:])


class BlockStore:
    """One cache's blocks in its tiers; see the module doc.

    ``lower``: the tiers below the device, fastest first; ``key_config``: what besides
    the tokens and ``model_id`` decides a block's content (the cache config and block
    size); ``sinks``: tokens before the first block (not part of any block key)."""

    def __init__(self, lower: list[Tier], write_policy: str, model_id: str, key_config: dict,
                 block_tokens: int, sinks: int):
        self.device_tier = DeviceTier(None, device="cpu")
        self.stack = TierStack([self.device_tier, *lower], write_policy=write_policy, promote=False)
        self.lower: list[Tier] = self.stack.tiers[1:]
        self.model_id, self.key_config = model_id, key_config
        self.block_tokens, self.sinks = block_tokens, sinks
        self.session = uuid.uuid4().hex[:16]
        self.refused = 0  # seals no tier took (the tokens stayed with their layer)
        self._prefix_hashes: list[str] = []  # one per whole block of the declared tokens

    # ---- keys -----------------------------------------------------------------------------
    def set_tokens(self, ids: list[int]) -> None:
        """Declare the token ids the cache holds or will hold: blocks inside them get
        content keys from now on. Without a model id (a cache that does not know its
        model: :mod:`~.recovery`) every block keeps a session key."""
        if self.model_id is None:
            self._prefix_hashes = []
            return
        hs = prefix_hashes(ids, self.block_tokens, self.model_id, self.key_config, first_block=self.sinks)
        self._prefix_hashes = hs[1:] if self.sinks else hs

    @property
    def content_blocks(self) -> int:
        """How many leading blocks have content keys (whole blocks of the declared tokens)."""
        return len(self._prefix_hashes)

    def key(self, layer_idx: int, block_idx: int) -> str:
        """The key of block ``block_idx`` of layer ``layer_idx``: by content when the
        declared tokens cover it, else private to this session."""
        if block_idx < len(self._prefix_hashes):
            return layer_key(self._prefix_hashes[block_idx], layer_idx)
        return f"s{self.session}-b{block_idx:05d}-L{layer_idx:02d}"

    def is_session_key(self, key: str) -> bool:
        return key.startswith("s" + self.session)

    def record_key(self, kind: str, ids: list[int]) -> str:
        """The key of a record about exactly ``ids`` (``kind``: "state", "sinks")."""
        return f"{kind}-" + sequence_hash(ids, self.model_id, self.key_config)

    # ---- writing --------------------------------------------------------------------------
    def put(self, key: str, block: dict) -> str | None:
        """Store a sealed block (device tier first, within its capacity); the name of the
        tier that took it, or None when none did (nothing was stored): counted in
        ``refused``, with one RuntimeWarning per store naming the block and each reason."""
        self.device_tier.device = block["k_codes"].device  # blocks stay where the model runs
        try:
            return self.stack.put(key, block)
        except TierFullError as e:
            self.refused += 1
            if self.refused == 1:
                warnings.warn(f"no tier can take KV block {key!r} ({block_nbytes(block)} bytes): {e}; "
                              "its layer keeps the tokens on the device (over budget) and tries again "
                              "at its next block; further refusals are only counted "
                              "(offload_stats()['refused_blocks'])", RuntimeWarning, stacklevel=6)
            return None

    def save_below(self, key: str, block) -> list[str]:
        """Make sure the lower tiers hold ``key``: ``block`` (a dict, or a function that
        returns it, called only if needed) goes to every lower tier that lacks it and takes
        it (a small host tier may not hold a prompt's state record). Returns the names of
        the tiers holding it afterwards; TierFullError when none does."""
        held, errors = [], []
        for t in self.lower:
            if t.contains(key):
                held.append(t.name)
                continue
            if callable(block):
                block = block()
            try:
                t.put(key, block)
                held.append(t.name)
            except (TierFullError, TierUnavailableError) as e:
                errors.append(f"{t.name}: {e}")
        if self.lower and not held:
            raise TierFullError(f"no tier can store {key!r}: " + "; ".join(errors))
        return held

    def delete(self, key: str) -> bool:
        return self.stack.delete(key)

    # ---- reading --------------------------------------------------------------------------
    def held_below(self, key: str) -> bool:
        return any(t.contains(key) for t in self.lower)

    def find_below(self, key: str) -> dict | None:
        """The record under ``key`` from the first lower tier holding it (None: none)."""
        return next((r for r in (t.get(key) for t in self.lower) if r is not None), None)

    def on_device(self, keys: list[str]) -> list[bool]:
        return self.device_tier.contains_many(keys)

    def fetch(self, key: str) -> dict:
        """One block from wherever it is; BlockLostError when no tier has it."""
        for _ in range(2):  # a block may be moving between tiers: look twice
            b = self.device_tier.get(key, touch=False)
            if b is not None:
                return b
            for t in self.lower:
                b = t.get(key)
                if b is not None:
                    return b
        raise BlockLostError(f"KV block {key!r} is in no tier (corrupted, deleted or evicted "
                             "from the last tier); give the last tier more capacity", key)

    def gather(self, keys: list[str], threads: int = 1) -> list[dict]:
        """The blocks of ``keys`` in order: device-tier blocks by reference, the rest as
        the copies just read, in one batch per lower tier (``threads`` files at a time)."""
        parts = self.device_tier.get_many(keys, touch=False)
        todo = [i for i, p in enumerate(parts) if p is None]
        for t in self.lower:  # DiskTier: one GIL-free call per batch
            if not todo:
                break
            got = t.get_many([keys[i] for i in todo], threads=threads)
            for i, b in zip(todo, got, strict=True):
                parts[i] = b
            todo = [i for i in todo if parts[i] is None]
        for i in todo:  # moved between tiers meanwhile, or lost: look again, or raise
            parts[i] = self.fetch(keys[i])
        return parts

    def close(self, keep_session: bool, keys: list[str]) -> None:
        """Delete this session's blocks among ``keys`` (unless ``keep_session``) and close
        the tiers (no flush: what was not written through is this session's only)."""
        if not keep_session:
            for k in keys:
                if self.is_session_key(k):
                    self.stack.delete(k)
        self.stack.close(flush=False)


def to_device(parts: list[dict], device) -> list[dict]:
    """``parts`` with every tensor on ``device`` (a copy only where one is elsewhere)."""
    if all(p["k_codes"].device == device for p in parts):
        return parts
    return [{n: t.to(device) for n, t in p.items()} for p in parts]


def join_parts(parts: list[dict]) -> dict:
    """One block dict from consecutive parts (tokens along dim 2)."""
    if len(parts) == 1:
        return parts[0]
    return {n: torch.cat([p[n] for p in parts], dim=2) for n in parts[0]}
