"""``QTensor``: a quantized tensor that knows its own bytes.

A QTensor holds the *codes* (packed integers, fp8 values or raw GGUF blocks), the
per-group ``scale`` and ``zero_point`` (or None), any extra metadata tensors (codebooks,
quantized sub-block scales), the format descriptor, and the original shape and dtype.

``nbytes`` is the sum of the bytes of every tensor it holds, metadata included, and
``bits_per_element`` is ``8 * nbytes / numel`` — the honest effective bits, so int4
with one fp16 scale per 32 elements reports 4.5.

Example:
    >>> import torch
    >>> from lessmem.formats import quantize, PerGroup
    >>> qt = quantize(torch.randn(64, 64), "int4", granularity=PerGroup(32))
    >>> qt.bits_per_element
    4.5
    >>> qt.dequantize().shape
    torch.Size([64, 64])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .granularity import Granularity, GroupMeta, PerTensor


@dataclass(frozen=True)
class QFormat:
    """What a QTensor's codes mean.

    kind: "int" | "fp8" | "codebook" | "gguf"; bits: bits per code; symmetric: for "int";
    variant: e.g. "e4m3fn" for fp8, "q4_k" for gguf, "lloyd-max" for codebooks.
    """

    kind: str
    bits: int
    granularity: Granularity = field(default_factory=PerTensor)
    symmetric: bool = True
    variant: str | None = None

    @property
    def name(self) -> str:
        if self.kind == "int":
            return f"{'int' if self.symmetric else 'uint'}{self.bits}"
        return f"{self.kind}-{self.variant}" if self.variant else self.kind


# kind -> dequantize function, filled in by each format module on import
DEQUANTIZERS: dict[str, Callable[[QTensor], torch.Tensor]] = {}
# kind -> integer-code reader (original layout), filled in the same way; this module never
# imports the format modules, so the formats package has no import circle
CODE_READERS: dict[str, Callable[[QTensor], torch.Tensor]] = {}


@dataclass
class QTensor:
    codes: torch.Tensor  # packed uint8 codes, fp8 values or raw blocks
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    fmt: QFormat
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: GroupMeta | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this QTensor holds (what ``nbytes`` counts)."""
        out = [self.codes]
        out += [t for t in (self.scale, self.zero_point) if t is not None]
        out += list(self.extra.values())
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.numel

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        fn = DEQUANTIZERS.get(self.fmt.kind)
        if fn is None:
            raise ValueError(f"no dequantizer for format kind {self.fmt.kind!r}")
        out = fn(self)
        return out.to(dtype or self.dtype)

    def int_codes(self) -> torch.Tensor:
        """Integer codes in the original layout (signed for symmetric int formats)."""
        fn = CODE_READERS.get(self.fmt.kind)
        if fn is None:
            raise ValueError(f"int_codes() needs an integer QTensor, this one is {self.fmt.name}")
        return fn(self)

    def __repr__(self) -> str:
        return (
            f"QTensor({self.fmt.name}, shape={tuple(self.shape)}, "
            f"granularity={self.fmt.granularity}, nbytes={self.nbytes}, "
            f"bits_per_element={self.bits_per_element:.4g})"
        )
