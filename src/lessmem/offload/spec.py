"""Tier lists as users type them (``--offload``) turned into tier objects.

The grammar (:func:`parse_offload_spec`, :class:`TierSpec`) and the one size rule
(:func:`parse_bytes`) live torch-free in :mod:`lessmem.base.tierspec` and
:mod:`lessmem.base.units`, so the planner reads and writes the same strings; they are
re-exported here, and :func:`build_tier` / :func:`build_tiers` make the tiers.

Example:
    >>> from lessmem.offload import parse_bytes, parse_offload_spec
    >>> parse_bytes("64MiB"), parse_bytes("64M"), parse_bytes("1.5 GB"), parse_bytes(4096)
    (67108864, 67108864, 1500000000, 4096)
    >>> [(s.kind, s.target, s.capacity) for s in parse_offload_spec("host@1GiB,disk:/tmp/kv")]
    [('host', None, 1073741824), ('disk', '/tmp/kv', None)]
"""

from __future__ import annotations

from lessmem.base.tierspec import KINDS, TierSpec, format_offload_spec, parse_offload_spec  # noqa: F401
from lessmem.base.units import parse_bytes  # noqa: F401


def check_block_tokens(block_tokens, block_size: int, owner: str = "the config") -> None:
    """ValueError unless ``block_tokens`` (tokens per stored KV block) is a positive multiple
    of the cache config's ``block_size`` (``owner`` names that config in the message)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1 \
            or block_tokens % block_size:
        raise ValueError(f"block_tokens={block_tokens!r}; allowed: a positive multiple of "
                         f"{owner}'s block_size {block_size}")


def build_tier(spec: TierSpec, capacity: int | None = None):
    """The tier object one :class:`TierSpec` names (``capacity`` overrides the spec's own).

    Example:
        >>> from lessmem.offload import build_tier, parse_offload_spec
        >>> t = build_tier(parse_offload_spec("host@1MiB")[0])
        >>> type(t).__name__, t.capacity
        ('HostTier', 1048576)
    """
    from .disk import DiskTier
    from .memory import DeviceTier, HostTier
    from .remote import RedisTier

    cap = spec.capacity if capacity is None else capacity
    if spec.kind == "device":
        return DeviceTier(cap)
    if spec.kind == "host":
        return HostTier(cap)
    if spec.kind == "disk":
        return DiskTier(spec.target, cap)
    return RedisTier(spec.target, cap)


def build_tiers(tiers) -> list:
    """Tier objects from a spec string, or a list of :class:`TierSpec` / Tier objects.

    Example:
        >>> from lessmem.offload import build_tiers
        >>> [type(t).__name__ for t in build_tiers("host@1MiB")]
        ['HostTier']
    """
    from .tier import Tier

    if isinstance(tiers, str):
        tiers = parse_offload_spec(tiers)
    if isinstance(tiers, (Tier, TierSpec)):
        tiers = [tiers]
    out = []
    for t in tiers:
        if isinstance(t, TierSpec):
            t = build_tier(t)
        if not isinstance(t, Tier):
            raise ValueError(f"tier {t!r}; allowed: Tier objects, TierSpecs or a spec string")
        out.append(t)
    if not out:
        raise ValueError("no tiers given; allowed: at least one of host, disk:PATH, redis://...")
    return out
