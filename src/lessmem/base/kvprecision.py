"""How one K/V element is stored, torch-free: the description the planner computes with.

``lessmem.kvcache.KVConfig.to_plan()`` derives one from a cache config, and
``lessmem.plan.kv`` holds the named presets and the byte arithmetic over it. It lives in
``base`` so that the cache (below the planner) can build it without importing ``plan``.

Example:
    >>> KVPrecision("int4", 4, 4, k_scale_bytes=2.0).k_bits
    4
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

QUALITY = ("reference", "near-lossless", "lossy")


@dataclass(frozen=True)
class KVPrecision:
    """How one K/V element is stored, and what metadata it carries (torch-free).

    ``*_group_tokens`` × ``*_group_channels`` elements share one scale (channels None =
    the whole head_dim). Bits 16 (or 32) with no scale = unquantized.
    """

    name: str
    k_bits: float
    v_bits: float
    k_group_tokens: int = 1
    k_group_channels: int | None = None
    v_group_tokens: int = 1
    v_group_channels: int | None = None
    k_scale_bytes: float = 0.0
    v_scale_bytes: float = 0.0
    k_zero_point_bytes: float = 0.0
    v_zero_point_bytes: float = 0.0
    window: int = 0
    sinks: int = 0
    block: int = 1
    full_bytes: float = 2.0
    skip_layers: int = 0
    rotated: bool = False
    quality: str = "lossy"
    description: str = ""

    def __post_init__(self):
        for k in ("k_bits", "v_bits"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= 32:
                raise ValueError(f"KV precision {self.name!r}: {k}={v!r}; allowed: 1 to 32 bits")
        for k in ("k_group_tokens", "v_group_tokens", "block"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KV precision {self.name!r}: {k}={v!r}; allowed: an integer >= 1")
        for k in ("k_group_channels", "v_group_channels"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"KV precision {self.name!r}: {k}={v!r}; allowed: None or an integer >= 1")
        for k in ("window", "sinks", "skip_layers"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KV precision {self.name!r}: {k}={v!r}; allowed: an integer >= 0")
        for k in ("k_scale_bytes", "v_scale_bytes", "k_zero_point_bytes", "v_zero_point_bytes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"KV precision {self.name!r}: {k}={v!r}; allowed: a number >= 0")
        if not isinstance(self.full_bytes, (int, float)) or self.full_bytes <= 0:
            raise ValueError(f"KV precision {self.name!r}: full_bytes={self.full_bytes!r} must be > 0")
        if self.quality not in QUALITY:
            raise ValueError(f"KV precision {self.name!r}: quality={self.quality!r}; allowed: {QUALITY}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> KVPrecision:
        """Inverse of ``to_dict`` (unknown keys are an error naming the allowed ones)."""
        allowed = set(KVPrecision.__dataclass_fields__)
        bad = set(d) - allowed
        if bad:
            raise ValueError(f"unknown KVPrecision field(s) {sorted(bad)}; allowed: {sorted(allowed)}")
        return KVPrecision(**d)
