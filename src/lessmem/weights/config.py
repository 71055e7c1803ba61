"""Weight-quantization configs: frozen dataclasses validated in ``__post_init__``.

Every config says how a linear layer's weight ``W [out, in]`` becomes codes:

- ``bits``: 2, 3, 4 or 8 (8 is per-channel symmetric int8, the fused int8 kernel)
- ``group_size``: 32, 64, 128, 256 contiguous input columns per scale, or ``None`` =
  one scale per output channel
- ``symmetric``: zero point fixed at 2^(b-1) (True) or chosen per group (False)
- ``skip``: name patterns (``fnmatch``) of linears kept in full precision
  (``lm_head`` by default; embeddings are never touched)
- ``overrides``: ``{pattern: {field: value}}`` per-module changes, e.g.
  ``{"*.down_proj": {"bits": 8, "group_size": None}}``; the first matching pattern wins
- ``group_fallback``: when ``group_size`` does not divide a layer's ``in_features``,
  use the largest allowed group size that does (True) or raise (False, the default)

Calibrated configs (GPTQ, AWQ, SmoothQuant) add ``n_samples`` windows of ``seq_len``
tokens of calibration text. ``FP8Config`` (float8_e4m3fn weights, per-channel float32
scales) and ``GGUFConfig`` (llama.cpp block types) have no bits or groups: their format
fixes them; both take ``skip`` patterns (FP8 also ``overrides``).

Example:
    >>> from lessmem.weights import RTNConfig
    >>> cfg = RTNConfig(overrides={"*.v_proj": {"bits": 8, "group_size": None, "symmetric": True}})
    >>> cfg.for_module("model.layers.0.v_proj").bits, cfg.for_module("model.layers.0.q_proj").bits
    (8, 4)
    >>> cfg.for_module("lm_head") is None
    True
    >>> RTNConfig(bits=7)
    Traceback (most recent call last):
    ...
    ValueError: RTNConfig bits=7 is not supported; allowed: 2, 3, 4, 8
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from dataclasses import dataclass

from .checks import _check_bool, _check_int

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128, 256)


def _as_patterns(owner: str, v) -> tuple[str, ...]:
    """``skip``: one name pattern or a list/tuple of them."""
    pats = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else None
    if pats is None or not all(isinstance(p, str) for p in pats):
        raise ValueError(f"{owner} skip={v!r} must be a name pattern or a list of name patterns "
                         "(strings)")
    return pats


def _check_float(name: str, owner: str, v, lo: float, hi: float, lo_open: bool = False):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = ok and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise ValueError(f"{owner} {name}={v!r} must be a number in {'(' if lo_open else '['}{lo}, {hi}]")


class _NameRules:
    """``skip`` and ``overrides`` of a frozen config dataclass: which config (if any) the
    linear named ``name`` gets (shared by ``WeightConfig`` and ``FP8Config``)."""

    def _norm_overrides(self, ov):
        owner = type(self).__name__
        items = ov.items() if isinstance(ov, dict) else ov
        if not isinstance(items, (list, tuple, type({}.items()))) or not all(
                isinstance(it, (list, tuple)) and len(it) == 2 for it in items):
            raise ValueError(f"{owner} overrides={ov!r} must be a dict of name pattern -> "
                             "{field: value} (or None: keep in full precision)")
        out = []
        names = {f.name for f in dataclasses.fields(self)} - {"overrides"}
        for pat, change in items:
            try:
                change = dict(change) if change is not None else None
            except (TypeError, ValueError):
                raise ValueError(f"{owner} overrides entry {pat!r}: {change!r} must be a dict "
                                 "{field: value} or None") from None
            if not isinstance(pat, str) or (change is not None and not set(change) <= names):
                bad = set(change or {}) - names
                raise ValueError(f"{owner} overrides entry {pat!r}: {change!r}; keys must be "
                                 f"among {', '.join(sorted(names))} (unknown: {sorted(bad)})")
            if change is not None:  # validate now so a bad override fails at construction
                dataclasses.replace(self, **change, overrides=())
            out.append((pat, tuple(sorted(change.items())) if change is not None else None))
        return tuple(out)

    def for_module(self, name: str):
        """The config for the linear named ``name``, or None to keep it in full precision."""
        for pat, change in self.overrides:
            if fnmatch.fnmatchcase(name, pat):
                if change is None:
                    return None
                return dataclasses.replace(self, **dict(change), overrides=())
        if any(fnmatch.fnmatchcase(name, p) or name.split(".")[-1] == p for p in self.skip):
            return None
        return self


@dataclass(frozen=True)
class WeightConfig(_NameRules):
    """Fields shared by every weight config (see the module doc)."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    skip: tuple[str, ...] = ("lm_head",)
    overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    group_fallback: bool = False

    method = "base"
    allowed_bits = BITS

    def __post_init__(self):
        owner = type(self).__name__
        _check_bool("symmetric", owner, self.symmetric)
        _check_bool("group_fallback", owner, self.group_fallback)
        if isinstance(self.bits, bool) or self.bits not in self.allowed_bits:
            raise ValueError(f"{owner} bits={self.bits!r} is not supported; allowed: "
                             f"{', '.join(map(str, self.allowed_bits))}")
        if self.group_size is not None and (isinstance(self.group_size, bool)
                                            or self.group_size not in GROUP_SIZES):
            raise ValueError(f"{owner} group_size={self.group_size!r}; allowed: None (per-channel), "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise ValueError(f"{owner} bits=8 is per-channel symmetric int8: use group_size=None, "
                             f"symmetric=True (got group_size={self.group_size!r}, "
                             f"symmetric={self.symmetric!r})")
        object.__setattr__(self, "skip", _as_patterns(owner, self.skip))
        object.__setattr__(self, "overrides", self._norm_overrides(self.overrides))

    def group_for(self, name: str, in_features: int) -> int:
        """Group size to use for a layer with ``in_features`` columns (in_features if per-channel)."""
        if self.group_size is None:
            return in_features
        if in_features % self.group_size == 0:
            return self.group_size
        fits = [g for g in GROUP_SIZES if g < self.group_size and in_features % g == 0]
        if self.group_fallback and fits:
            return fits[-1]
        raise ValueError(
            f"{type(self).__name__} group_size={self.group_size} does not divide in_features="
            f"{in_features} of {name!r}; allowed here: "
            f"{[g for g in GROUP_SIZES if in_features % g == 0] or 'None (per-channel)'} "
            "(or set group_fallback=True, or an override for this module)")

    @property
    def needs_calibration(self) -> bool:
        return False

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["skip"] = list(self.skip)
        d["overrides"] = {p: (dict(c) if c is not None else None) for p, c in self.overrides}
        d["method"] = self.method
        return d

    @staticmethod
    def from_dict(d: dict) -> WeightConfig | FP8Config:
        """The config ``to_dict`` wrote (``method`` picks the class; default ``"rtn"``;
        ``"fp8"`` gives an ``FP8Config``)."""
        if not isinstance(d, dict):
            raise TypeError(f"WeightConfig.from_dict needs a dict as written by to_dict(), got "
                            f"{type(d).__name__}")
        d = dict(d)
        method = d.pop("method", "rtn")
        classes = {c.method: c for c in (RTNConfig, GPTQConfig, AWQConfig, SmoothQuantConfig,
                                         HQQConfig, FP8Config)}
        if method not in classes:
            raise ValueError(f"method={method!r}; allowed: {', '.join(classes)}")
        cls = classes[method]
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{cls.__name__}.from_dict: unknown keys {sorted(unknown)}; allowed: "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if isinstance(d.get("skip"), list):
            d["skip"] = tuple(d["skip"])
        return cls(**d)


@dataclass(frozen=True)
class RTNConfig(WeightConfig):
    """Round-to-nearest, no calibration: per group, min/max (or max|w|) sets the scale."""

    method = "rtn"


@dataclass(frozen=True)
class HQQConfig(WeightConfig):
    """Half-Quadratic Quantization (Badri & Shaji 2023), no calibration: per group, the scale
    from min/max, then the zero point fitted by ``iters`` half-quadratic iterations on the
    lp error (p = ``lp_norm`` <= 1: generalised soft-thresholding of the error with weight
    ``beta``, grown by ``kappa`` each step, then a closed-form zero update), stopping when
    the error stops improving; zero points are stored as integers (QuantLinear's uint8), so
    the scale is then refitted the same way around the rounded zero (``weights.hqq``).
    Errors are measured in quantization steps, so ``beta`` does not depend on how wide a
    model's weights are: errors above beta^(-1/(2-p)) steps (≈15 at the defaults) count as
    sparse outliers (the paper's beta=10 is in raw weight units).

    Groups always run along input columns (HQQ's ``axis=1``), the layout the fused kernels
    hold. ``symmetric=True`` (and ``bits=8``, per-channel symmetric) fits the scale only.

    Example:
        >>> HQQConfig(bits=3).group_size, HQQConfig().lp_norm
        (64, 0.7)
        >>> HQQConfig(lp_norm=1.5)
        Traceback (most recent call last):
        ...
        ValueError: HQQConfig lp_norm=1.5 must be a number in (0.0, 1.0]
    """

    group_size: int | None = 64
    iters: int = 20
    lp_norm: float = 0.7
    beta: float = 0.03
    kappa: float = 1.01

    method = "hqq"

    def __post_init__(self):
        super().__post_init__()
        _check_int("iters", "HQQConfig", self.iters, 0, 1000)
        _check_float("lp_norm", "HQQConfig", self.lp_norm, 0.0, 1.0, lo_open=True)
        _check_float("beta", "HQQConfig", self.beta, 0.0, 1e12, lo_open=True)
        _check_float("kappa", "HQQConfig", self.kappa, 1.0, 10.0)


@dataclass(frozen=True)
class CalibratedConfig(WeightConfig):
    n_samples: int = 32
    seq_len: int = 512

    def __post_init__(self):
        super().__post_init__()
        _check_int("n_samples", type(self).__name__, self.n_samples, 1)
        _check_int("seq_len", type(self).__name__, self.seq_len, 8)

    @property
    def needs_calibration(self) -> bool:
        return True


@dataclass(frozen=True)
class GPTQConfig(CalibratedConfig):
    """GPTQ (Frantar et al. 2022): quantize columns in order, push each column's error onto
    the not-yet-quantized ones through the inverse Hessian of the layer's inputs.

    damp: fraction of mean(diag H) added to the diagonal (raised x10 while Cholesky fails);
    block_size: columns per lazy batch update; act_order: columns by decreasing diag H
    (needs static_groups=True so each group keeps contiguous columns for the kernels);
    true_sequential: within a block, quantize attention before MLP, each on inputs
    recomputed with the already-quantized layers.
    """

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True

    method = "gptq"

    def __post_init__(self):
        super().__post_init__()
        for flag in ("act_order", "static_groups", "true_sequential"):
            _check_bool(flag, "GPTQConfig", getattr(self, flag))
        _check_float("damp", "GPTQConfig", self.damp, 0.0, 1.0, lo_open=True)
        _check_int("block_size", "GPTQConfig", self.block_size, 1, 4096)
        if self.act_order and not self.static_groups and self.group_size is not None:
            raise ValueError("GPTQConfig act_order=True with group_size set needs static_groups=True "
                             "(groups must stay contiguous columns for the fused kernels)")


@dataclass(frozen=True)
class AWQConfig(CalibratedConfig):
    """AWQ (Lin et al. 2023): per-input-channel scales s = mean|x|^α, α searched over
    ``n_grid`` values in [0, 1) on the block output error, folded into the preceding norm or
    linear; then a per-group clipping search (shrink max|w| by up to ``max_shrink``)."""

    n_grid: int = 20
    clip_search: bool = True
    max_shrink: float = 0.5
    search_samples: int | None = None  # windows used by the α search (None: all; fewer on CPU)

    method = "awq"

    def __post_init__(self):
        super().__post_init__()
        _check_int("n_grid", "AWQConfig", self.n_grid, 1, 200)
        _check_bool("clip_search", "AWQConfig", self.clip_search)
        _check_float("max_shrink", "AWQConfig", self.max_shrink, 0.0, 0.9)
        if self.search_samples is not None:
            _check_int("search_samples", "AWQConfig", self.search_samples, 1)


@dataclass(frozen=True)
class SmoothQuantConfig(CalibratedConfig):
    """SmoothQuant W8A8 (Xiao et al. 2022): s_j = max|X_j|^α / max|W_j|^(1−α) folded into the
    preceding norm, then int8 per-channel weights and int8 per-token dynamic activations."""

    alpha: float = 0.5
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True

    method = "smoothquant"
    allowed_bits = (8,)

    def __post_init__(self):
        super().__post_init__()
        _check_float("alpha", "SmoothQuantConfig", self.alpha, 0.0, 1.0)


__all__ = ["WeightConfig", "RTNConfig", "HQQConfig", "GPTQConfig", "AWQConfig", "SmoothQuantConfig", "GGUFConfig",
           "FP8Config", "CalibratedConfig", "BITS", "GROUP_SIZES"]


@dataclass(frozen=True)
class GGUFConfig:
    """Apply a GGUF type or llama.cpp mix (``"Q4_K_M"``, ``"Q6_K"``, ``"Q8_0"``, ``"Q4_0"`` …) to
    a model's linears in memory: each weight is encoded with ``formats.gguf`` in the type the
    mix rules give it (``gguf_mix.tensor_type``) and its ``nn.Linear`` replaced by a
    ``GGUFLinear`` holding the raw blocks (fused dequant-matmul, what llama.cpp computes with);
    only an ``lm_head`` tied to the embeddings is decoded back in place (see
    ``weights.gguf_apply``). ``skip``: name patterns left untouched.

    ``imatrix``: an importance matrix (``weights.imatrix``: an ``IMatrix`` from
    ``collect_imatrix``/``read_imatrix``, or the path of a llama.cpp imatrix file, GGUF or
    legacy ``.dat``, read and checked here): every linear it has an entry for is encoded
    with that entry's per-column importance, as ``llama-quantize --imatrix`` does; linears
    without one are encoded without, entries naming no linear are ignored, and an entry
    whose length is not the linear's column count is a ``ValueError`` naming the tensor
    (raised by ``apply_gguf`` before any layer changes).

    ``gptq=True``: calibrated encoding (``weights.gguf_gptq``): block by block over
    ``n_samples`` windows of ``seq_len`` tokens of the calibration text (as ``GPTQConfig``),
    each block's scales chosen by llama.cpp's quantizer weighted by the importance the pass
    measures, and the codes with GPTQ's error feedback (``damp``: GPTQ's damping); the
    blocks and the file layout are llama.cpp's, only the codes differ. ``awq=True``: first
    AWQ's per-channel scales (``weights.awq``, searched over ``n_grid`` exponents with the
    linears' own block types as the quantizer, on the first ``search_samples`` windows)
    folded into the preceding norm or linear, then each linear encoded with the importance
    measured after the fold (by GPTQ when ``gptq=True`` too). Neither with ``imatrix``.

    Example:
        >>> GGUFConfig("Q4_K_M").type
        'Q4_K_M'
        >>> GGUFConfig("Q3_K_XL")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: GGUF type 'Q3_K_XL' is not supported; allowed: Q4_0, Q4_1, Q8_0, ..., IQ4_XS
        >>> GGUFConfig("Q4_K_M", imatrix=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: GGUFConfig imatrix=3 must be an IMatrix (collect_imatrix / read_imatrix) or the path ...
    """

    type: str = "Q4_K_M"
    skip: tuple[str, ...] = ()
    imatrix: object = dataclasses.field(default=None, hash=False)
    gptq: bool = False
    awq: bool = False
    n_samples: int = 32
    seq_len: int = 512
    damp: float = 0.01
    n_grid: int = 20
    search_samples: int | None = 16  # windows AWQ's scale search runs (None: all n_samples)

    method = "gguf"

    @property
    def needs_calibration(self) -> bool:
        return self.gptq or self.awq

    def __post_init__(self):
        from .gguf_mix import check_mix

        if not isinstance(self.type, str):
            raise ValueError(f"GGUFConfig type={self.type!r} must be a GGUF type or mix name such as "
                             "'Q4_K_M'")
        object.__setattr__(self, "type", check_mix(self.type))
        object.__setattr__(self, "skip", _as_patterns("GGUFConfig", self.skip))
        _check_bool("gptq", "GGUFConfig", self.gptq)
        _check_bool("awq", "GGUFConfig", self.awq)
        _check_int("n_grid", "GGUFConfig", self.n_grid, 1, 200)
        if self.search_samples is not None:
            _check_int("search_samples", "GGUFConfig", self.search_samples, 1)
        _check_int("n_samples", "GGUFConfig", self.n_samples, 1)
        _check_int("seq_len", "GGUFConfig", self.seq_len, 8)
        _check_float("damp", "GGUFConfig", self.damp, 0.0, 1.0, lo_open=True)
        if self.needs_calibration and self.imatrix is not None:
            raise ValueError("GGUFConfig gptq=True / awq=True weigh each block's scales by the importance "
                             "their own calibration pass measures; pass those or imatrix=..., not both")
        if self.imatrix is not None:
            from .imatrix import as_imatrix

            try:
                object.__setattr__(self, "_imatrix", as_imatrix(self.imatrix, "GGUFConfig imatrix"))
            except ValueError as exc:
                msg = str(exc)
                if not msg.startswith("GGUFConfig"):
                    msg = f"GGUFConfig imatrix={self.imatrix!r}: {msg}"
                raise ValueError(msg) from None

    def imatrix_data(self):
        """The ``IMatrix`` to encode with (read from the file once, at construction), or None."""
        return getattr(self, "_imatrix", None)

    def to_dict(self) -> dict:
        d = {"method": "gguf", "type": self.type, "skip": list(self.skip)}
        if self.needs_calibration:
            d.update(gptq=self.gptq, awq=self.awq, n_samples=self.n_samples, seq_len=self.seq_len)
            d.update({"damp": self.damp} if self.gptq else {})
            d.update({"n_grid": self.n_grid, "search_samples": self.search_samples} if self.awq else {})
        if self.imatrix is not None:  # what was given: a file, or an in-memory matrix
            im = self.imatrix_data()
            d["imatrix"] = (os.fspath(self.imatrix) if isinstance(self.imatrix, (str, os.PathLike))
                            else f"in memory ({len(im)} entries)")
        return d


FP8_ACTS = ("fp8", None)
FP8_FORMATS = ("e4m3",)


@dataclass(frozen=True)
class FP8Config(_NameRules):
    """FP8 weights (``weights.fp8``), no calibration: each selected linear's weight is held
    as ``float8_e4m3fn [N, K]`` with one float32 scale per output channel (max|w_row| / 448),
    in an ``FP8Linear``: 8 + 32/K bits per weight.

    - ``act``: ``"fp8"`` (W8A8: activations quantized per token to e4m3 on the fly, the
      product through ``torch._scaled_mm``, what Hopper GPUs serve with) or ``None``
      (weight-only W8A16: the weight is dequantized to the activations' dtype for the matmul)
    - ``fmt``: the FP8 format of the weights; only ``"e4m3"`` (e5m2 trades mantissa for a
      range weights do not need)
    - ``skip`` / ``overrides``: name patterns as in ``WeightConfig`` (``lm_head`` kept in full
      precision by default; an override may change ``act`` or, with None, keep a module float)

    Example:
        >>> FP8Config().act, FP8Config(act=None).for_module("model.layers.0.mlp.up_proj").act
        ('fp8', None)
        >>> FP8Config().for_module("lm_head") is None
        True
        >>> FP8Config(act="int8")
        Traceback (most recent call last):
        ...
        ValueError: FP8Config act='int8'; allowed: 'fp8' (W8A8) or None (weight-only)
    """

    act: str | None = "fp8"
    fmt: str = "e4m3"
    skip: tuple[str, ...] = ("lm_head",)
    overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    method = "fp8"
    needs_calibration = False

    def __post_init__(self):
        if not (self.act is None or (isinstance(self.act, str) and self.act in FP8_ACTS)):
            raise ValueError(f"FP8Config act={self.act!r}; allowed: 'fp8' (W8A8) or None (weight-only)")
        if not isinstance(self.fmt, str) or self.fmt not in FP8_FORMATS:
            raise ValueError(f"FP8Config fmt={self.fmt!r}; allowed: {', '.join(map(repr, FP8_FORMATS))}")
        object.__setattr__(self, "skip", _as_patterns("FP8Config", self.skip))
        object.__setattr__(self, "overrides", self._norm_overrides(self.overrides))

    def to_dict(self) -> dict:
        return {"method": self.method, "act": self.act, "fmt": self.fmt, "skip": list(self.skip),
                "overrides": {p: (dict(c) if c is not None else None) for p, c in self.overrides}}
