"""The device budget: bytes the tiered caches may hold on the device, and who holds what.

A :class:`DeviceBudget` is a byte limit (None = unbounded) shared by every cache that
opens a :class:`BudgetAccount` on it — one cache, or a batch of requests served
together. An account is one cache's claim: what its layers hold on the device whatever
happens (sinks, windows, partial blocks), what the current forward still adds, the
room kept for histories read from lower tiers, and its *device tier* (its most recent
sealed blocks), which gets what is left. The arithmetic is :mod:`lessmem.base.placement`,
the same the planner replays.

``rebalance`` (before every read of a layer's history and every seal) sizes the
device tiers so that all accounts together stay within the limit: the other accounts'
device tiers keep what they hold as long as it fits, the calling account's gets the
rest (and may demote its oldest blocks). When the limit is below what the accounts
need even with empty device tiers, the read goes ahead over budget: counted
(``over_budget``) and warned about once per budget.

Example:
    >>> from lessmem.offload import DeviceTier
    >>> budget = DeviceBudget("8KiB")
    >>> a = budget.open(DeviceTier(None, device="cpu"), prefetch=False)
    >>> b = budget.open(DeviceTier(None, device="cpu"), prefetch=False)
    >>> budget.limit, len(budget.accounts)
    (8192, 2)
"""

from __future__ import annotations

import threading
import warnings
import weakref

from ...base.placement import device_need, device_room, staging_reserve
from ...offload import MemoryTier, parse_bytes


class DeviceBudget:
    """A device byte limit shared by the accounts opened on it; see the module doc."""

    def __init__(self, limit=None):
        self.limit = self._parse(limit)
        self._accounts: weakref.WeakSet[BudgetAccount] = weakref.WeakSet()  # a dropped cache stops counting
        self.over_budget = 0  # rebalances at which even empty device tiers could not meet the limit
        self.peak = 0  # the most bytes all accounts held on the device together (sampled at reads)
        self._lock = threading.RLock()
        self._warned = False

    @property
    def accounts(self) -> list[BudgetAccount]:
        """The open accounts (closed caches and caches no longer referenced do not count)."""
        with self._lock:
            return list(self._accounts)

    @staticmethod
    def _parse(limit) -> int | None:
        return None if limit is None else parse_bytes(limit, "device_budget")

    def open(self, device_tier: MemoryTier, prefetch: bool, in_flight=None) -> BudgetAccount:
        """A new account whose device tier is ``device_tier`` (``prefetch``: keep room for
        a second history in flight; ``in_flight``: a function returning the bytes of reads
        in flight, held on the device too)."""
        account = BudgetAccount(self, device_tier, prefetch, in_flight)
        with self._lock:
            self._accounts.add(account)
        return account

    def release(self, account: BudgetAccount) -> None:
        """Forget a closed account (its device bytes no longer count)."""
        with self._lock:
            self._accounts.discard(account)

    def set_limit(self, limit) -> None:
        """Change the limit (bytes or ``"64MiB"``; None = unbounded); the next rebalance
        of each account applies it."""
        self.limit = self._parse(limit)
        if self.limit is None:
            for a in self.accounts:
                a.device_tier.resize(None)

    def rebalance(self, account: BudgetAccount, need: float) -> None:
        """Size the device tiers for ``account`` needing ``need`` bytes besides its device
        tier (the other accounts as they last said)."""
        with self._lock:
            account.last_need = need
            account.needed = max(account.needed, need)
            if self.limit is None:
                return
            accounts = list(self._accounts)
            room = device_room(self.limit, sum(a.last_need for a in accounts))
            if room < 0:
                account.over_budget += 1
                self.over_budget += 1
                self._warn(need, room)
            left = int(max(0, room))
            for other in accounts:  # others keep what they hold while it fits
                if other is not account:
                    keep = min(other.device_tier.nbytes, left)
                    other.device_tier.resize(keep)
                    left -= keep
            account.device_tier.resize(left)

    def _warn(self, need: float, room: float) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"device_budget={self.limit} bytes is below what the tiered KV cache must hold on the "
            f"device ({self.limit - int(room)} bytes: sinks, windows, partial blocks, this forward's "
            "tokens and the histories read from lower tiers); it holds more than its budget now. "
            "Allowed: a larger budget, or shorter prefill chunks; further reads over budget are "
            "only counted (offload_stats()['over_budget'])", RuntimeWarning, stacklevel=5)

    def record(self, account: BudgetAccount, device_bytes: int) -> None:
        """Note what ``account`` holds on the device now (for ``peak``)."""
        with self._lock:
            account.last_bytes = device_bytes
            account.peak = max(account.peak, device_bytes)
            self.peak = max(self.peak, sum(a.last_bytes for a in self._accounts))


class BudgetAccount:
    """One cache's claim on a :class:`DeviceBudget`; see the module doc.

    The cache's layers tell it what changes: ``changed()`` when a layer's blocks or
    partial block change, ``forward_tokens`` the tokens of the forward now running,
    ``staged`` the bytes of histories read from lower tiers and held beside the device
    tier; ``in_flight`` is a function returning the bytes of reads still in flight."""

    def __init__(self, budget: DeviceBudget, device_tier: MemoryTier, prefetch: bool, in_flight=None):
        self.budget, self.device_tier, self.prefetch = budget, device_tier, bool(prefetch)
        self.resident_layers: list = []  # layers whose sinks/window/partial block stay on the device
        self.tiered_layers: list = []  # layers whose history is in the tiers
        self.forward_tokens = 1
        self.staged = 0
        self.in_flight = in_flight or (lambda: 0)
        self.last_need = 0.0
        self.last_bytes = 0
        self.needed = 0.0  # the most this account needed besides its device tier
        self.peak = 0  # the most it held on the device (sampled at reads)
        self.over_budget = 0
        self._version = 0
        self._sums: dict[str, tuple] = {}

    def attach(self, resident_layers: list, tiered_layers: list) -> None:
        """The layers this account counts (the cache's, once built)."""
        self.resident_layers, self.tiered_layers = list(resident_layers), list(tiered_layers)
        self.changed()

    def changed(self) -> None:
        """A layer's blocks or partial block changed: sums cached for this step are stale."""
        self._version += 1

    def _cached(self, name: str, compute):
        key = (self._version, len(self.resident_layers))
        got = self._sums.get(name)
        if got is None or got[0] != key:
            got = self._sums[name] = (key, compute())
        return got[1]

    def resident(self) -> int:
        """Bytes that always stay on the device: every layer's sinks, window, partial block."""
        return sum(layer.fp_bytes() for layer in self.resident_layers)

    def growth(self) -> int:
        """What the layers still to run in this forward add to their windows."""
        return self.forward_tokens * self._cached(
            "token", lambda: sum(layer.token_bytes() for layer in self.resident_layers))

    def reserve(self) -> int:
        """Room for histories read from lower tiers (the largest attended history, twice
        with prefetch; kept in "hint" mode too, so the planner's split does not depend on
        the machine's cores)."""
        return self._cached("reserve", lambda: staging_reserve(
            max((layer.visible_history_bytes() for layer in self.tiered_layers), default=0), self.prefetch))

    def need(self, resident: int | None = None) -> float:
        """Bytes needed on the device besides the device tier."""
        return device_need(self.resident() if resident is None else resident, self.growth(), self.reserve())

    def rebalance(self, resident: int | None = None) -> None:
        """Resize the device tiers of the budget for what this account needs now."""
        self.budget.rebalance(self, self.need(resident))

    def device_bytes(self, resident: int | None = None) -> int:
        """Bytes this cache holds on the device now: device tier, resident, staged, in flight."""
        resident = self.resident() if resident is None else resident
        return self.device_tier.nbytes + resident + self.staged + self.in_flight()

    def record_peak(self, resident: int | None = None) -> None:
        self.budget.record(self, self.device_bytes(resident))

    def close(self) -> None:
        self.budget.release(self)
