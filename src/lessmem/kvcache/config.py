"""KV-cache configuration: how keys and values are stored, and the named presets.

A :class:`KVConfig` holds one :class:`KVTensorConfig` for keys and one for values, plus
the parts kept in full precision (``sinks``: the first tokens; ``window``: the most
recent tokens), the block size in which tokens leave the window, Hadamard rotation,
layers left unquantized, and the behaviour of sliding-window layers.

Granularity on a ``[B, H, T, D]`` key/value tensor (always a Granularity object):

- ``PerGroup(G, axis=-2)``: per channel, one scale per G tokens of each channel
  (KIVI keys). ``block_size`` must be a multiple of G.
- ``PerToken()``: one scale per token vector of ``D`` elements.
- ``PerGroup(g, axis=-1)``: per token, one scale per g channels (g divides D).

Effective bits of one stored element (codes + scale + zero point, shared over the
group of n elements): ``bits + (16 [fp16 scale] + 8 [uint8 zero point, asymmetric
only]) / n``.

Example:
    >>> from lessmem.kvcache import KVConfig, PRESETS
    >>> from lessmem.formats import PerGroup
    >>> cfg = PRESETS["kivi-4"]
    >>> cfg.keys.granularity == PerGroup(32, axis=-2), cfg.window
    (True, 128)
    >>> round(cfg.keys.effective_bits(64), 3)
    4.75
    >>> KVConfig.from_dict(cfg.to_dict()) == cfg
    True
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ..formats.granularity import Granularity, PerGroup, PerToken

FORMATS = ("none", "int", "uint", "fp8-e4m3", "fp8-e5m2", "lm")
SLIDING = ("exact", "quantize")
WINDOW_DTYPES = ("fp16", "bf16", "fp32", "model")
KEY_ROUNDING = ("nearest", "attention")


class ConfigTypeError(TypeError, ValueError):
    """A config field, argument or dict of the wrong type (``bits="4"``, ``rotate_keys="yes"``).

    It is a TypeError, and also a ValueError so that code catching every bad config as
    ValueError (the CLI does) still catches it."""


def _allowed_granularity() -> str:
    return "PerGroup(G, axis=-2) (per channel, G tokens), PerToken(), PerGroup(g, axis=-1)"


def _got(v) -> str:
    return f" (got a {type(v).__name__})"


def _check_int(name, v, lo=None) -> int:
    """``v`` as a plain int; numpy integers are accepted, bool/str/float are not."""
    bound = "" if lo is None else f" >= {lo}"
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ConfigTypeError(f"{name}={v!r}; allowed: an integer{bound}{_got(v)}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}={v!r}; allowed: an integer{bound}")
    return int(v)


def _check_bool(name, v) -> bool:
    """``v`` as a plain bool; numpy bools are accepted, 0/1, strings and None are not."""
    if not isinstance(v, (bool, np.bool_)):
        raise ConfigTypeError(f"{name}={v!r}; allowed: True or False{_got(v)}")
    return bool(v)


def _check_keys(owner: str, d, names: list[str]) -> dict:
    """``d`` as a dict holding exactly the keys ``to_dict`` writes (``names``)."""
    if not isinstance(d, dict):
        raise ConfigTypeError(f"{owner}.from_dict({d!r}); allowed: a dict as written by "
                              f"{owner}.to_dict(){_got(d)}")
    unknown = sorted(map(repr, set(d) - set(names)))
    missing = [n for n in names if n not in d]
    if unknown or missing:
        found = "; ".join(s for s in (f"unknown keys {', '.join(unknown)}" if unknown else "",
                                      f"missing keys {', '.join(missing)}" if missing else "") if s)
        raise ValueError(f"{owner}.from_dict: {found}; allowed: exactly the keys {owner}.to_dict() "
                         f"writes: {', '.join(names)} (for a partial config use {owner}(...) or "
                         f"PRESETS[name].replace(...))")
    return dict(d)


def _sequence(name: str, v) -> tuple:
    """A tuple/list field as a tuple (a lone str, number or dict is refused, not iterated)."""
    if not isinstance(v, (tuple, list, range)):
        raise ConfigTypeError(f"{name}={v!r}; allowed: a tuple or list{_got(v)}")
    return tuple(v)


@dataclass(frozen=True)
class KVTensorConfig:
    """How one of keys/values is quantized: ``format``, ``bits``, ``granularity``.

    ``format``: ``"none"`` (full precision), ``"int"`` (symmetric), ``"uint"``
    (asymmetric, uint8 zero point), ``"fp8-e4m3"``/``"fp8-e5m2"`` (bits 8, scaled),
    ``"lm"`` (Lloyd-Max codebook for a Gaussian, scaled by the group's RMS).

    ``channel_bits`` (keys, ``"uint"`` per channel only): each stored channel's own bits,
    0 to 8, non-increasing (``bits`` is their largest; 0-bit channels keep their group's
    mean); ``channel_order``: the model channel stored at each position, one permutation
    for all KV heads or one per head after another (() = the model's order). Calibrated
    per model by :mod:`lessmem.eval.channels` (``lessmem kv-allocate --channels``).

    Example:
        >>> from lessmem.formats import PerToken
        >>> KVTensorConfig("uint", 4, PerToken()).effective_bits(64)
        4.375
    """

    format: str = "uint"
    bits: int = 4
    granularity: Granularity = field(default_factory=PerToken)
    clip_ratio: float = 1.0
    channel_bits: tuple[int, ...] = ()
    channel_order: tuple[int, ...] = ()

    def __post_init__(self):
        self._check_channels()
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}; allowed: {', '.join(FORMATS)}")
        allowed_bits = {"none": (16,), "int": (2, 3, 4, 8), "uint": (2, 3, 4, 8),
                        "lm": (2, 3, 4)}.get(self.format, (8,))
        listed = ", ".join(map(str, allowed_bits))
        if isinstance(self.bits, bool) or not isinstance(self.bits, numbers.Integral):
            raise ConfigTypeError(f"bits={self.bits!r} for format {self.format!r}; allowed: an "
                                  f"integer, one of {listed}{_got(self.bits)}")
        object.__setattr__(self, "bits", int(self.bits))
        if self.format == "none":
            return  # full precision: bits and granularity are not used
        if self.bits not in allowed_bits and not (self.channel_bits and 1 <= self.bits <= 8):
            raise ValueError(f"bits={self.bits!r} for format {self.format!r}; allowed: {listed}")
        g = self.granularity
        ok = isinstance(g, PerToken) or (isinstance(g, PerGroup) and g.axis in (-1, -2))
        if not ok:
            raise ValueError(f"granularity={g!r}; allowed: {_allowed_granularity()}")
        c = self.clip_ratio
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise ConfigTypeError(f"clip_ratio={c!r}; allowed: a number in [0.5, 1.0]{_got(c)}")
        if not (math.isfinite(c) and 0.5 <= c <= 1.0):
            raise ValueError(f"clip_ratio={c!r}; allowed: a number in [0.5, 1.0]")
        object.__setattr__(self, "clip_ratio", float(c))

    def _check_channels(self) -> None:
        """``channel_bits`` / ``channel_order`` (see the class doc) as tuples, checked."""
        cb = _sequence("channel_bits", self.channel_bits)
        order = _sequence("channel_order", self.channel_order)
        object.__setattr__(self, "channel_bits", tuple(_check_int("channel_bits entry", b, 0) for b in cb))
        object.__setattr__(self, "channel_order", tuple(_check_int("channel_order entry", i, 0) for i in order))
        cb, order = self.channel_bits, self.channel_order
        if not cb and not order:
            return
        if not cb:
            raise ValueError("channel_order without channel_bits; allowed: both (channel_order may be () "
                             "for the model's order)")
        if self.format != "uint" or not self.per_channel:
            raise ValueError(f"channel_bits with format {self.format!r} {self.granularity!r}; allowed: "
                             "format 'uint' per channel (PerGroup(G, axis=-2))")
        if any(b > 8 for b in cb) or any(a < b for a, b in zip(cb, cb[1:], strict=False)):
            raise ValueError(f"channel_bits={cb!r}; allowed: integers 0 to 8, non-increasing (the stored "
                             "channels sorted by their bits)")
        if self.bits != max(cb):
            raise ValueError(f"bits={self.bits!r} with channel_bits; allowed: their largest, {max(cb)}")
        n = len(cb)
        if order and (len(order) % n or any(sorted(order[i:i + n]) != list(range(n))
                                            for i in range(0, len(order), n))):
            raise ValueError(f"channel_order={order!r}; allowed: a permutation of 0..{n - 1} (the model "
                             "channel stored at each position), or one such permutation per KV head, "
                             "one after another")

    @property
    def code_bits(self) -> float:
        """Code bits per element: ``bits``, or the mean of ``channel_bits``."""
        return sum(self.channel_bits) / len(self.channel_bits) if self.channel_bits else float(self.bits)

    @property
    def quantized(self) -> bool:
        return self.format != "none"

    @property
    def per_channel(self) -> bool:
        return isinstance(self.granularity, PerGroup) and self.granularity.axis == -2

    @property
    def has_zero_point(self) -> bool:
        return self.format == "uint"

    def group_shape(self, head_dim: int) -> tuple[int, int]:
        """(tokens, channels) sharing one scale."""
        g = self.granularity
        if self.per_channel:
            return g.size, 1
        if isinstance(g, PerGroup):
            return 1, g.size
        return 1, head_dim

    def effective_bits(self, head_dim: int) -> float:
        """Stored bits per element: codes + fp16 scale + uint8 zero point per group."""
        if not self.quantized:
            return 16.0
        tg, dg = self.group_shape(head_dim)
        return self.code_bits + (16 + (8 if self.has_zero_point else 0)) / (tg * dg)

    def to_dict(self) -> dict:
        d = {"format": self.format, "bits": self.bits,
             "granularity": self.granularity.to_dict(), "clip_ratio": self.clip_ratio}
        if self.channel_bits:  # written only when used: files of earlier versions stay valid
            d["channel_bits"], d["channel_order"] = list(self.channel_bits), list(self.channel_order)
        return d

    @staticmethod
    def from_dict(d: dict) -> KVTensorConfig:
        """Inverse of ``to_dict``: exactly its keys (unknown or missing keys are an error)."""
        if isinstance(d, dict):
            d = {"channel_bits": (), "channel_order": (), **d}
        d = _check_keys("KVTensorConfig", d, [f.name for f in fields(KVTensorConfig)])
        g = d["granularity"]
        if not isinstance(g, dict):
            raise ConfigTypeError(f"granularity={g!r}; allowed: a dict as written by "
                                  f"Granularity.to_dict(), e.g. {PerToken().to_dict()}{_got(g)}")
        try:
            d["granularity"] = Granularity.from_dict(g)
        except TypeError as e:  # a known kind with unknown fields: PerGroup(**d) refuses them
            raise ValueError(f"granularity={g!r}: {e}; allowed: a dict as written by "
                             f"Granularity.to_dict(), e.g. {PerGroup(32).to_dict()}") from None
        return KVTensorConfig(**d)


NONE = KVTensorConfig("none", 16)


def _override(o) -> tuple:
    """One ``layer_overrides`` entry as ``(layer, KVTensorConfig, KVTensorConfig)``."""
    if not (isinstance(o, (tuple, list)) and len(o) == 3 and isinstance(o[1], KVTensorConfig)
            and isinstance(o[2], KVTensorConfig)):
        raise ConfigTypeError(f"layer_overrides entry {o!r}; allowed: (layer, KVTensorConfig, "
                              "KVTensorConfig)")
    return _check_int("layer_overrides layer", o[0], 0), o[1], o[2]


@dataclass(frozen=True)
class KVConfig:
    """A quantized KV-cache configuration; see the module doc.

    ``layer_overrides``: ``((layer, keys, values), ...)`` gives some layers their own
    :class:`KVTensorConfig` pair (e.g. a sensitive first layer at more bits).
    ``skip_layers``: layers kept entirely in full precision.
    ``sliding``: for sliding-window layers, ``"exact"`` keeps transformers' bounded
    full-precision sliding layer; ``"quantize"`` quantizes them like the other layers
    and drops the blocks that slid out of the window
    (:class:`~lessmem.kvcache.layer.SlidingQuantizedKVLayer`: no sinks there, at most
    ``sliding_window + block_size`` tokens held). Chunked-attention layers under
    ``"quantize"`` keep every block (the mask hides the other chunks).
    ``window_dtype``: dtype of the full-precision parts (``"model"``: as computed).
    ``key_rounding``: how per-channel integer keys pick their codes, once their scales and
    zero points are set: ``"nearest"`` rounds each value; ``"attention"`` rounds them in
    order with the error fed forward (GPTQ) under the second moment of the layer's queries,
    so what the scores lose is smallest (:mod:`lessmem.kvcache.key_rounding`). The stored
    layout and the attention kernels are the same either way.

    Example:
        >>> from lessmem.formats import PerToken
        >>> KVConfig(keys=KVTensorConfig("int", 8, PerToken()), window=0).window
        0
        >>> KVConfig(window=-1)
        Traceback (most recent call last):
        ...
        ValueError: window=-1; allowed: an integer >= 0
    """

    keys: KVTensorConfig = field(default_factory=KVTensorConfig)
    values: KVTensorConfig = field(default_factory=KVTensorConfig)
    window: int = 128
    sinks: int = 4
    block_size: int = 32
    rotate_keys: bool = False
    rotate_values: bool = False
    rotation_seed: int = 0
    skip_layers: tuple[int, ...] = ()
    layer_overrides: tuple[tuple[int, KVTensorConfig, KVTensorConfig], ...] = ()
    sliding: str = "exact"
    window_dtype: str = "fp16"
    key_rounding: str = "nearest"

    def __post_init__(self):
        """Check every field (numpy ints/bools are stored as plain int/bool)."""
        for name in ("keys", "values"):
            if not isinstance(getattr(self, name), KVTensorConfig):
                raise ConfigTypeError(f"{name}={getattr(self, name)!r}; allowed: a KVTensorConfig")
        for name, lo in (("window", 0), ("sinks", 0), ("block_size", 1), ("rotation_seed", 0)):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), lo))
        for name in ("rotate_keys", "rotate_values"):
            object.__setattr__(self, name, _check_bool(name, getattr(self, name)))
        for name, allowed in (("sliding", SLIDING), ("window_dtype", WINDOW_DTYPES), ("key_rounding", KEY_ROUNDING)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {', '.join(allowed)}")
        object.__setattr__(self, "skip_layers", tuple(
            _check_int("skip_layers entry", i, 0) for i in _sequence("skip_layers", self.skip_layers)))
        ovs = tuple(_override(o) for o in _sequence("layer_overrides", self.layer_overrides))
        object.__setattr__(self, "layer_overrides", ovs)
        for _layer, k, v in ((None, self.keys, self.values), *ovs):
            if k.channel_bits and self.rotate_keys:
                raise ValueError("keys with channel_bits and rotate_keys=True; allowed: rotate_keys=False "
                                 "(channel bits are calibrated on the model's own key channels)")
            if v.channel_bits:
                raise ValueError("channel_bits on the values; allowed: on the keys only (per-channel "
                                 "groups are a key layout)")
            for t in (k, v):
                if t.per_channel and self.block_size % t.granularity.size:
                    raise ValueError(
                        f"block_size={self.block_size} must be a multiple of the per-channel token "
                        f"group {t.granularity.size}; allowed: block sizes {t.granularity.size}, "
                        f"{2 * t.granularity.size}, ..."
                    )

    @property
    def quantized(self) -> bool:
        return self.keys.quantized or self.values.quantized or any(
            k.quantized or v.quantized for _, k, v in self.layer_overrides)

    def for_layer(self, layer: int) -> tuple[KVTensorConfig, KVTensorConfig]:
        """(keys, values) config of one layer (full precision for skipped layers)."""
        if layer in self.skip_layers:
            return NONE, NONE
        for i, k, v in self.layer_overrides:
            if i == layer:
                return k, v
        return self.keys, self.values

    def effective_bits(self, head_dim: int, num_layers: int | None = None) -> tuple[float, float]:
        """Mean (key bits, value bits) over quantized layers (all layers when ``num_layers``)."""
        n = num_layers or 1
        pairs = [self.for_layer(i) for i in range(n)] if num_layers else [(self.keys, self.values)]
        kb = sum(k.effective_bits(head_dim) for k, _ in pairs) / len(pairs)
        vb = sum(v.effective_bits(head_dim) for _, v in pairs) / len(pairs)
        return kb, vb

    def to_plan(self, name: str = "lessmem", full_bytes: float = 2.0, num_layers: int | None = None):
        """The planner's torch-free description (``lessmem.base.kvprecision.KVPrecision``).

        ``full_bytes``: bytes per full-precision element (2 for fp16 windows; the model's
        element size for ``window_dtype="model"``). Per-layer overrides that change only
        the bits (same granularity and zero point as the base side, as
        :func:`lessmem.eval.allocate.allocate` writes) are described by their mean bits
        over ``num_layers`` layers, which is then required; other overrides raise ValueError.

        Example:
            >>> from lessmem.kvcache import PRESETS
            >>> p = PRESETS["kivi-4"].to_plan("kivi-4")
            >>> p.k_group_tokens, p.v_group_tokens, p.window, p.block
            (32, 1, 128, 32)
        """
        from ..base.kvprecision import KVPrecision

        mean_bits = None
        if self.layer_overrides:
            mean_bits = self._mean_override_bits(num_layers)
        if not self.quantized:
            return KVPrecision(name, 8 * full_bytes, 8 * full_bytes, full_bytes=full_bytes,
                               quality="reference")

        def side(t: KVTensorConfig):
            tg, dg = t.group_shape(10**9)
            return (t.code_bits, tg, None if dg == 10**9 else dg, 2.0, 1.0 if t.has_zero_point else 0.0)

        kb, ktg, kdg, ks, kz = side(self.keys)
        vb, vtg, vdg, vs, vz = side(self.values)
        if mean_bits is not None:
            kb, vb = mean_bits
        return KVPrecision(name, kb, vb, ktg, kdg, vtg, vdg, ks, vs, kz, vz, self.window, self.sinks,
                           self.block_size, full_bytes, len(set(self.skip_layers)),
                           self.rotate_keys or self.rotate_values)

    def _mean_override_bits(self, num_layers) -> tuple[float, float]:
        """Mean (key, value) code bits over the quantized layers, for ``to_plan``."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
            raise ValueError(f"to_plan: a config with layer_overrides needs num_layers (the model's "
                             f"layer count); got {num_layers!r}")
        over = [i for i, _, _ in self.layer_overrides if i >= num_layers]
        if over:
            raise ValueError(f"to_plan: layer_overrides name layer {over[0]}; allowed: layers 0 to "
                             f"{num_layers - 1} (num_layers={num_layers})")
        pairs = [self.for_layer(i) for i in range(num_layers) if i not in self.skip_layers]
        for _, k, v in self.layer_overrides:
            for t, base in ((k, self.keys), (v, self.values)):
                if t.granularity != base.granularity or t.has_zero_point != base.has_zero_point \
                        or not t.quantized:
                    raise ValueError("to_plan: layer_overrides that change more than the bits "
                                     f"({t.format} {t.granularity!r} against {base.format} "
                                     f"{base.granularity!r}) cannot be described to the planner; "
                                     "allowed: overrides of the bits only")
        if not pairs:
            return self.keys.code_bits, self.values.code_bits
        return (sum(k.code_bits for k, _ in pairs) / len(pairs),
                sum(v.code_bits for _, v in pairs) / len(pairs))

    def replace(self, **changes) -> KVConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["keys"], d["values"] = self.keys.to_dict(), self.values.to_dict()
        d["skip_layers"] = list(self.skip_layers)
        d["layer_overrides"] = [[i, k.to_dict(), v.to_dict()] for i, k, v in self.layer_overrides]
        return d

    @staticmethod
    def from_dict(d: dict) -> KVConfig:
        """Inverse of ``to_dict`` (JSON-safe: lists for tuples): exactly its keys, unknown
        or missing keys are an error; the values are checked as the constructor checks them."""
        if isinstance(d, dict) and "key_rounding" not in d:  # written before the field existed
            d = {**d, "key_rounding": "nearest"}
        d = _check_keys("KVConfig", d, [f.name for f in fields(KVConfig)])
        for name in ("keys", "values"):
            if isinstance(d[name], dict):
                d[name] = KVTensorConfig.from_dict(d[name])
        overrides = []
        for o in _sequence("layer_overrides", d["layer_overrides"]):
            if not (isinstance(o, (list, tuple)) and len(o) == 3 and isinstance(o[1], dict)
                    and isinstance(o[2], dict)):
                raise ValueError(f"layer_overrides entry {o!r}; allowed: [layer, keys dict, "
                                 "values dict] as written by to_dict()")
            overrides.append((o[0], KVTensorConfig.from_dict(o[1]), KVTensorConfig.from_dict(o[2])))
        d["layer_overrides"] = tuple(overrides)
        return KVConfig(**d)
