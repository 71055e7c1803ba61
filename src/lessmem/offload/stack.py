"""``TierStack``: tiers in order (fastest first), placement and demotion.

- ``put``: write-back puts into the first tier that takes the block and lets LRU
  eviction demote blocks one tier down (``on_evict``); write-through also writes every
  lower tier before returning (so a crash loses nothing that was put).
- A demoted block goes to the first lower tier that holds or takes it. When none can
  (disk full, Redis unreachable) the demotion raises :class:`TierFullError` and the
  evicting tier keeps the block (over its capacity, counted, one warning): a block
  leaves a tier only after a lower tier has taken it.
- ``get``: searches fastest to slowest; with ``promote`` a block found below is copied
  into the first tier (which may demote others).

Reading ahead in the background is the KV cache's job
(:class:`lessmem.kvcache.tiered.prefetch.Prefetcher`), not the stack's.

Example:
    >>> import torch, tempfile
    >>> from lessmem.offload import TierStack, DeviceTier, DiskTier
    >>> s = TierStack([DeviceTier(300, device="cpu"), DiskTier(tempfile.mkdtemp())])
    >>> _ = s.put("a", {"x": torch.zeros(64)}); _ = s.put("b", {"x": torch.ones(64)})  # 256 B each
    >>> s.where("a"), s.where("b")                 # "a" was demoted to disk
    ('disk', 'device')
    >>> s.get("a")["x"].sum().item()
    0.0
"""

from __future__ import annotations

import warnings

from .tier import Tier, TierFullError, TierUnavailableError

WRITE_POLICIES = ("write-back", "write-through")
_REFUSALS = (TierFullError, TierUnavailableError)  # a tier that raises these stored nothing


class TierStack:
    """Ordered tiers (fastest first) behind one put/get/delete interface."""

    def __init__(self, tiers: list[Tier], write_policy: str = "write-back", promote: bool = True):
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(f"tiers={tiers!r} must be a non-empty list of Tier objects")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names {names} must be unique")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={write_policy!r}; allowed: {', '.join(WRITE_POLICIES)}")
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.promote = bool(promote)
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(i)

    def _demoter(self, i: int):
        def demote(key: str, block: dict) -> None:
            self._put_from(i + 1, key, block)
        return demote

    def _put_from(self, start: int, key: str, block: dict) -> str:
        """Put into the first tier at or below ``start`` that holds or takes the block;
        returns its name. TierFullError (every tier's reason) when none can."""
        reasons = []
        for t in self.tiers[start:]:
            if t.contains(key):
                return t.name
            try:
                t.put(key, block)
                return t.name
            except _REFUSALS as e:
                reasons.append(f"{t.name}: {e}")
        raise TierFullError(f"no tier below {self.tiers[start - 1].name if start else 'the top'} "
                            f"took block {key!r}: " + "; ".join(reasons))

    def put(self, key: str, block: dict, start: int = 0) -> str:
        """Store ``block``; returns the name of the tier that took it first.
        TierFullError (every tier's reason) when no tier took it."""
        placed, reasons = None, []
        for t in self.tiers[start:]:
            try:
                t.put(key, block)
            except _REFUSALS as e:
                reasons.append(f"{t.name}: {e}")
                continue
            placed = placed or t.name
            if self.write_policy == "write-back":
                break
        if placed is None:
            raise TierFullError(f"no tier could take block {key!r}: " + "; ".join(reasons))
        return placed

    def get(self, key: str, promote: bool | None = None) -> dict | None:
        for i, t in enumerate(self.tiers):
            block = t.get(key)
            if block is not None:
                if i > 0 and (self.promote if promote is None else promote):
                    try:
                        self.tiers[0].put(key, block)
                    except _REFUSALS:
                        pass  # the copy below is still there
                return block
        return None

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
        return {t.name: t.stats.to_dict() for t in self.tiers}

    def flush(self) -> list[str]:
        """Write-back: copy every block held only in upper tiers one tier further down.
        Returns the keys no lower tier took (one RuntimeWarning names how many)."""
        failed = []
        for i, t in enumerate(self.tiers[:-1]):
            for key in t.keys():
                block = t.get(key)
                if block is None:
                    continue
                try:
                    self._put_from(i + 1, key, block)
                except TierFullError:
                    failed.append(key)
        if failed:
            warnings.warn(f"flush: no lower tier took {len(failed)} block(s) (first: {failed[0]!r}); "
                          "they are only in the upper tiers", RuntimeWarning, stacklevel=2)
        return failed

    def close(self, flush: bool = True) -> None:
        """Flush (write-back, unless ``flush=False``) and close every tier."""
        if flush and self.write_policy == "write-back":
            self.flush()
        for t in self.tiers:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
