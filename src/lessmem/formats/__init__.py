"""The formats layer: how a tensor becomes codes and back (torch and numpy only).

``quantize(x, fmt, **options)`` is the one entry point; ``fmt`` is a format name:

- ``"int2"`` … ``"int8"`` symmetric integers, ``"uint2"`` … ``"uint8"`` asymmetric
  (options: ``granularity``, ``clip_ratio``, ``scale_dtype``)

- ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q8_0"``, ``"q2_k"`` … ``"q6_k"``: GGUF
  blocks with llama.cpp's exact byte layout (no options; see ``formats.gguf``)

- ``"fp8-e4m3"`` (= ``"fp8-e4m3fn"``, ±448), ``"fp8-e4m3fnuz"`` (±240), ``"fp8-e5m2"``
  (±57344), ``"fp8-e5m2fnuz"``: torch float8 codes with saturating casts (options:
  ``granularity``, ``scale_dtype``, ``clip_ratio``, ``scaled``; see ``formats.fp8``)
- ``"lm1"`` … ``"lm6"``: Lloyd-Max codebook indices, bit-packed (options: ``granularity``,
  ``fit="gaussian"|"data"``, ``norm``, ``scale_dtype``, ``codebook``; see ``formats.codebook``)

Further format families register themselves in ``QUANTIZERS`` on import.

Example:
    >>> import torch
    >>> from lessmem.formats import quantize, PerGroup
    >>> qt = quantize(torch.randn(8, 64), "uint4", granularity=PerGroup(32))
    >>> round(qt.bits_per_element, 3)
    4.625
"""

from __future__ import annotations

import re
from typing import Callable

from . import _vml  # noqa: F401  (first: its import makes the VML warm-up call)
from .codebook import fit_codebook, gaussian_codebook, quantize_codebook
from .fp8 import FP8_FORMATS, quantize_fp8
from .gguf import GGUF_PATTERN, dequantize_gguf, quantize_gguf, quantize_gguf_qtensor
from .granularity import Granularity, PerChannel, PerGroup, PerTensor, PerToken, SuperBlock
from .hadamard import HadamardRotation, fwht
from .integer import quantize_int
from .metrics import error_stats, snr_db
from .qtensor import QFormat, QTensor

# format-name pattern -> factory(x, match, **options) -> QTensor
QUANTIZERS: dict[str, Callable] = {
    r"int([2-8])": lambda x, m, **kw: quantize_int(x, int(m.group(1)), symmetric=True, **kw),
    r"uint([2-8])": lambda x, m, **kw: quantize_int(x, int(m.group(1)), symmetric=False, **kw),
}
_FP8 = r"fp8-(e4m3|e4m3fn|e4m3fnuz|e5m2|e5m2fnuz)"
QUANTIZERS[_FP8] = lambda x, m, **kw: quantize_fp8(x, m.group(1), **kw)
QUANTIZERS[r"lm([1-6])"] = lambda x, m, **kw: quantize_codebook(x, int(m.group(1)), **kw)
# how format_names() spells a pattern for people (default: the pattern itself)
_LABELS = {_FP8: "fp8-e4m3 (=fp8-e4m3fn), fp8-e4m3fnuz, fp8-e5m2, fp8-e5m2fnuz",
           r"lm([1-6])": "lm1..lm6"}
# GGUF block formats, raw llama.cpp bytes: q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k,
# iq4_nl iq4_xs (the last two encode/decode only, no kernel)
QUANTIZERS[GGUF_PATTERN] = lambda x, m, **kw: quantize_gguf_qtensor(x, m.group(0), **kw)


def format_names() -> list[str]:
    """Human list of the accepted format names."""
    return ["int2..int8", "uint2..uint8",
            *[_LABELS.get(p, p) for p in QUANTIZERS if not p.startswith(("int", "uint"))]]


def quantize(x, fmt: str = "int8", **options) -> QTensor:
    """Quantize ``x`` in the named format; see the module doc for names and options."""
    if not isinstance(fmt, str):
        raise ValueError(f"format={fmt!r} must be a string; allowed: {', '.join(format_names())}")
    for pattern, factory in QUANTIZERS.items():
        m = re.fullmatch(pattern, fmt.lower())
        if m:
            return factory(x, m, **options)
    raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(format_names())}")


__all__ = [
    "QTensor", "QFormat", "quantize", "quantize_int", "Granularity", "PerTensor", "PerChannel",
    "PerToken", "PerGroup", "SuperBlock", "HadamardRotation", "fwht", "snr_db", "error_stats",
    "QUANTIZERS", "format_names", "quantize_gguf", "dequantize_gguf",
    "quantize_fp8", "FP8_FORMATS", "quantize_codebook", "gaussian_codebook", "fit_codebook",
]
