"""FP8 (E4M3 / E5M2) through torch's float8 dtypes, with scales and saturating casts.

x_hat = s · fp8(clamp(x / s, -fmax, fmax)),   s = clip · amax(group) / fmax

``s`` is stored in ``scale_dtype`` *before* the codes are chosen; the clamp runs before
the cast, so values past the range saturate to ±fmax and never become NaN or inf
(torch's casts to the ``fnuz`` dtypes turn overflow into NaN; the clamp prevents it).
Codes are the fp8 values themselves, one byte each, in the grouped layout ``[G, E]``.

Which E4M3 is which (``FP8_FORMATS`` holds the numbers, checked against torch.finfo):

- ``fp8-e4m3`` = ``fp8-e4m3fn`` → ``torch.float8_e4m3fn`` (OCP/NVIDIA "E4M3FN"): bias 7,
  no infinities, a single NaN mantissa pattern (S.1111.111), so the top exponent still
  holds finite values: max ±448, smallest subnormal 2^-9. This is what H100/MI300 FP8
  GEMMs and vLLM's "fp8_e4m3" mean.
- ``fp8-e4m3fnuz`` → ``torch.float8_e4m3fnuz`` (AMD MI300/Graphcore): bias 8, no
  infinities, no negative zero (0x80 is the only NaN): max ±240, smallest subnormal 2^-10.
  A strictly IEEE-754-style E4M3 (top exponent reserved for inf/NaN, bias 7) would also
  top out at 1.875·2^7 = ±240, which is the ±240 that many texts quote; torch has no
  dtype for that variant, and ``float8_e4m3fnuz`` is the one that shares its range.
- ``fp8-e5m2`` → ``torch.float8_e5m2``: IEEE-style (inf and NaN), bias 15, max ±57344,
  smallest subnormal 2^-16 (wide range, 2 mantissa bits: gradients, some KV caches).
- ``fp8-e5m2fnuz`` → ``torch.float8_e5m2fnuz``: bias 16, no inf, no -0: max ±57344,
  smallest subnormal 2^-17.

Example:
    >>> import torch
    >>> from lessmem.formats import quantize, PerToken
    >>> qt = quantize(torch.tensor([[1.0, -2.0, 900.0]]), "fp8-e4m3", scaled=False)
    >>> qt.dequantize().tolist()      # 900 saturates to the e4m3fn maximum
    [[1.0, -2.0, 448.0]]
    >>> qt = quantize(torch.randn(4, 64), "fp8-e4m3", granularity=PerToken())
    >>> qt.bits_per_element   # 1 byte per code + one fp32 scale per 64 elements
    8.5
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._checks import check_clip_ratio, check_float_tensor, check_scale_dtype
from .granularity import Granularity, PerTensor, SuperBlock
from .integer import _store
from .qtensor import DEQUANTIZERS, QFormat, QTensor


@dataclass(frozen=True)
class FP8Spec:
    """One fp8 encoding: bit split, exponent bias, range and special values."""

    variant: str
    dtype: torch.dtype
    exp_bits: int
    man_bits: int
    bias: int
    max: float  # largest finite magnitude (saturation point)
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_neg_zero: bool
    note: str


FP8_FORMATS: dict[str, FP8Spec] = {
    "e4m3fn": FP8Spec("e4m3fn", torch.float8_e4m3fn, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9,
                      False, True, "OCP E4M3FN: no inf, NaN = S.1111.111; max 448"),
    "e4m3fnuz": FP8Spec("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, 240.0, 2.0**-7, 2.0**-10,
                        False, False, "bias 8, no inf, no -0, NaN = 0x80; max 240 (the "
                        "range of IEEE-style E4M3 too)"),
    "e5m2": FP8Spec("e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16,
                    True, True, "IEEE-style E5M2 with inf and NaN; max 57344"),
    "e5m2fnuz": FP8Spec("e5m2fnuz", torch.float8_e5m2fnuz, 5, 2, 16, 57344.0, 2.0**-15,
                        2.0**-17, False, False, "bias 16, no inf, no -0, NaN = 0x80; max 57344"),
}

ALIASES = {"e4m3": "e4m3fn", "e4m3fn": "e4m3fn", "e4m3fnuz": "e4m3fnuz", "e5m2": "e5m2",
           "e5m2fnuz": "e5m2fnuz"}


def fp8_spec(variant: str) -> FP8Spec:
    """The :class:`FP8Spec` for ``"e4m3"``/``"e4m3fn"``/``"e4m3fnuz"``/``"e5m2"``/``"e5m2fnuz"``.

    Example:
        >>> from lessmem.formats.fp8 import fp8_spec
        >>> fp8_spec("e4m3").max, fp8_spec("e4m3fnuz").max, fp8_spec("e5m2").max
        (448.0, 240.0, 57344.0)
    """
    key = ALIASES.get(variant.lower() if isinstance(variant, str) else variant)
    if key is None:
        raise ValueError(f"fp8 variant={variant!r}; allowed: {', '.join(ALIASES)}")
    return FP8_FORMATS[key]


def saturate_cast(y: torch.Tensor, spec: FP8Spec) -> torch.Tensor:
    """float32 -> fp8 with overflow clamped to ±max (never NaN/inf), round-to-nearest-even."""
    return y.float().clamp(-spec.max, spec.max).to(spec.dtype)


def quantize_fp8(x: torch.Tensor, variant: str = "e4m3fn", granularity: Granularity | None = None,
                 scale_dtype: torch.dtype | str = torch.float32, clip_ratio: float = 1.0,
                 scaled: bool = True) -> QTensor:
    """Quantize ``x`` to fp8 with one scale per group (see the module doc).

    ``scaled=False`` skips scaling (s = 1, no scale tensor held): a plain saturating cast.

    Example:
        >>> import torch
        >>> from lessmem.formats.fp8 import quantize_fp8
        >>> qt = quantize_fp8(torch.linspace(-1, 1, 256), "e5m2")
        >>> qt.nbytes        # 256 one-byte codes + one fp32 scale
        260
    """
    spec = fp8_spec(variant)
    check_float_tensor(x)
    clip_ratio = check_clip_ratio(clip_ratio)
    scale_dtype = check_scale_dtype(scale_dtype)
    if not isinstance(scaled, bool):
        raise ValueError(f"scaled={scaled!r} must be True or False")
    granularity = PerTensor() if granularity is None else granularity
    if not isinstance(granularity, Granularity) or isinstance(granularity, SuperBlock):
        raise ValueError(
            f"granularity={granularity!r} is not allowed for fp8; allowed: PerTensor(), "
            "PerChannel(axis), PerToken(), PerGroup(size) (SuperBlock is for integer formats)"
        )
    xg, meta = granularity.group(x)  # [G, E]
    xf = xg.float()
    if scaled:
        amax = xf.abs().amax(dim=1) * clip_ratio  # [G]
        scale = _store(amax / spec.max, scale_dtype)  # [G], rounded before coding
        codes = saturate_cast(xf / scale.float().unsqueeze(1), spec)
    else:
        scale = None
        codes = saturate_cast(xf, spec)
    fmt = QFormat("fp8", 8, granularity, True, spec.variant)
    return QTensor(codes, scale, None, fmt, tuple(x.shape), x.dtype, meta)


@functools.lru_cache(maxsize=None)
def _decode_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 value of each of the 256 bit patterns (NaN where the format says so)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def _to_float(codes: torch.Tensor) -> torch.Tensor:
    # torch's CPU fp8 -> fp32 casts run ~0.6 GB/s for the e4m3 / fnuz dtypes (e5m2 is a
    # cheap widening to fp16); a 256-entry table lookup is ~4x faster, bit-identical
    if codes.device.type != "cpu" or codes.dtype == torch.float8_e5m2:
        return codes.float()
    return torch.take(_decode_table(codes.dtype), codes.view(torch.uint8).long())


def _dequantize_fp8(qt: QTensor) -> torch.Tensor:
    y = _to_float(qt.codes)  # [G, E]
    if qt.scale is not None:
        y = y * qt.scale.float().unsqueeze(1)
    return Granularity.ungroup(y, qt.meta)


DEQUANTIZERS["fp8"] = _dequantize_fp8
