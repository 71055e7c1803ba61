"""Parsing what users type: byte sizes (``"64MiB"``) and tier lists (``--offload``).

``parse_offload_spec("host@2GiB,disk:/var/kv@20GiB,redis://127.0.0.1:6379/0")`` gives one
:class:`TierSpec` per comma-separated entry, fastest first:

- ``device[@SIZE]``                 where attention runs (CUDA memory, or RAM on CPU)
- ``host[@SIZE]``                   CPU RAM
- ``disk:PATH[@SIZE]``              a directory (created if missing)
- ``redis://HOST:PORT/DB[@SIZE]``   a shared Redis store (``rediss://`` and ``unix://`` too)

``@SIZE`` is a capacity in bytes; without it the tier is unbounded (the device budget
usually comes from ``--kv-budget``). Sizes follow :func:`lessmem.plan.units.parse_bytes`
(one rule for every command): ``KB``/``MB``/``GB`` are 1000-based, ``KiB``/``MiB``/``GiB``
and a bare ``K``/``M``/``G`` 1024-based.

Example:
    >>> from lessmem.offload import parse_bytes, parse_offload_spec
    >>> parse_bytes("64MiB"), parse_bytes("64M"), parse_bytes("1.5 GB"), parse_bytes(4096)
    (67108864, 67108864, 1500000000, 4096)
    >>> [(s.kind, s.target, s.capacity) for s in parse_offload_spec("host@1GiB,disk:/tmp/kv")]
    [('host', None, 1073741824), ('disk', '/tmp/kv', None)]
"""

from __future__ import annotations

from dataclasses import dataclass

from lessmem.plan.units import parse_bytes  # the one size rule (torch-free); re-exported here

KINDS = ("device", "host", "disk", "remote")


@dataclass(frozen=True)
class TierSpec:
    """One tier as written on the command line: ``kind``, ``target`` (path or URL), ``capacity``."""

    kind: str
    target: str | None = None
    capacity: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tier kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind in ("disk", "remote") and not self.target:
            raise ValueError(f"a {self.kind} tier needs a {'path' if self.kind == 'disk' else 'URL'}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 0):
            raise ValueError(f"capacity={self.capacity!r} must be a non-negative int or None")

    def build(self, capacity: int | None = None):
        """The tier object (``capacity`` overrides the spec's own)."""
        from .disk import DiskTier
        from .memory import DeviceTier, HostTier
        from .remote import RedisTier

        cap = self.capacity if capacity is None else capacity
        if self.kind == "device":
            return DeviceTier(cap)
        if self.kind == "host":
            return HostTier(cap)
        if self.kind == "disk":
            return DiskTier(self.target, cap)
        return RedisTier(self.target, cap)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "capacity": self.capacity}


def _split_size(entry: str) -> tuple[str, int | None]:
    if "@" in entry:
        head, tail = entry.rsplit("@", 1)
        try:
            return head, parse_bytes(tail)
        except ValueError:
            if not entry.startswith(("redis://", "rediss://", "unix://")):
                raise
    return entry, None


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
            t = t.build()
        if not isinstance(t, Tier):
            raise ValueError(f"tier {t!r}; allowed: Tier objects, TierSpecs or a spec string")
        out.append(t)
    if not out:
        raise ValueError("no tiers given; allowed: at least one of host, disk:PATH, redis://...")
    return out


def parse_offload_spec(text: str) -> list[TierSpec]:
    """``"host,disk:/path@10GiB,redis://h:6379/0"`` -> list of :class:`TierSpec` (see module doc)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"offload spec {text!r} is empty; e.g. 'host,disk:/path,redis://127.0.0.1:6379/0'")
    out = []
    for raw in text.split(","):
        entry, cap = _split_size(raw.strip())
        if entry in ("device", "host"):
            out.append(TierSpec(entry, None, cap))
        elif entry.startswith("disk:") and len(entry) > 5:
            out.append(TierSpec("disk", entry[5:], cap))
        elif entry.startswith(("redis://", "rediss://", "unix://")):
            out.append(TierSpec("remote", entry, cap))
        else:
            raise ValueError(f"offload tier {raw.strip()!r} is not understood; allowed: device[@SIZE], "
                             "host[@SIZE], disk:PATH[@SIZE], redis://HOST:PORT/DB[@SIZE]")
    kinds = [s.kind for s in out]
    for k in ("device", "host"):
        if kinds.count(k) > 1:
            raise ValueError(f"offload spec {text!r} names the {k} tier twice")
    return out
