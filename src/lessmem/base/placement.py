"""The device-budget policy of a tiered KV cache, in plain arithmetic (no torch).

A tiered cache (:class:`lessmem.kvcache.tiered.TieredKVCache`) keeps some bytes on the
device whatever its budget, and fills the rest of the budget with its most recent
sealed blocks (the *device tier*); older blocks go to the lower tiers. The planner
(:func:`lessmem.plan.tiers.tier_split`) replays the same rule on paper. Both use these
functions, so they cannot drift apart.

What the cache needs on the device besides its device tier (``device_need``):

- ``resident``: sinks, windows and partly filled blocks of every layer (always there; a
  window as held: its tokens rounded up to ``WINDOW_GRAIN``, ``window_capacity``);
- ``growth``: the full-precision tokens this forward still adds to the layers that
  have not run yet (``tokens × bytes per token of all layers``);
- ``reserve``: room for the histories read from lower tiers: the layer computing now
  and, with prefetch, the next one (``staging_reserve``).

The device tier gets what is left (``device_room``); a negative room means the budget
is below what the cache needs (the cache counts and warns; it never drops data). Each
tier's share is then a block count (``blocks_kept``).

The device tier is *implicit*: its size is the budget, so a list of lower tiers never
names it (``check_lower_tiers``).

Example:
    >>> need = device_need(resident=3000, growth=200, reserve=staging_reserve(1000, prefetch=True))
    >>> need, device_room(8000, need), blocks_kept(device_room(8000, need), block_bytes=1000)
    (5200, 2800, 2)
"""

from __future__ import annotations

#: histories held beside the device tier: the layer computing now, and the one being prefetched
STAGED_LAYERS_WITH_PREFETCH = 2

# A quantized layer's full-precision window lives in a buffer whose capacity is its tokens
# rounded up to WINDOW_GRAIN (lessmem.kvcache.layer): a decode token is written into the room,
# and the buffer grows (one copy of the window) every WINDOW_GRAIN tokens. A buffer sized for
# the fullest window (window + block_size tokens) from the first token held up to
# block_size + 16 empty tokens a layer: a short request in the serving engine held 3x its
# tokens, and a cache's bytes read below what it held.
WINDOW_GRAIN = 16


def window_capacity(tokens: int) -> int:
    """Tokens a window buffer holding ``tokens`` tokens has room for (``WINDOW_GRAIN``)."""
    return -(-tokens // WINDOW_GRAIN) * WINDOW_GRAIN


def staging_reserve(largest_history: int, prefetch: bool) -> int:
    """Bytes kept free for histories read from lower tiers: the largest layer history
    (the blocks attention reads) once, twice with prefetch (the next layer in flight)."""
    return largest_history * (STAGED_LAYERS_WITH_PREFETCH if prefetch else 1)


def device_need(resident: float, growth: float, reserve: float) -> float:
    """Bytes the cache needs on the device besides its device tier (see the module doc)."""
    return resident + growth + reserve


def device_room(budget: int | None, need: float) -> float | None:
    """Bytes left for the device tier (negative: the budget is below ``need``); None when
    the budget is unbounded."""
    return None if budget is None else budget - need


def blocks_kept(room: float | None, block_bytes: int) -> int | None:
    """How many blocks of ``block_bytes`` the device tier keeps in ``room`` bytes (None:
    unbounded)."""
    if room is None:
        return None
    return int(max(0, room)) // block_bytes


def check_lower_tiers(specs, what: str = "tiers", budget_name: str = "device_budget") -> None:
    """ValueError when a list of lower tiers names the device tier (any item whose
    ``kind`` is ``"device"``): the device tier is implicit, its size is the budget."""
    if any(getattr(s, "kind", None) == "device" for s in specs or ()):
        raise ValueError(f"{what} names the device tier; the device tier is implicit (set its size "
                         f"with {budget_name}); allowed: host, disk:PATH, redis://...")


__all__ = ["staging_reserve", "device_need", "device_room", "blocks_kept", "check_lower_tiers",
           "STAGED_LAYERS_WITH_PREFETCH"]
