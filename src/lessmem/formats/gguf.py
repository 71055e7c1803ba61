"""GGUF block formats with GGUF's exact byte layout (llama.cpp ``ggml-quants``).

Legacy blocks of 32 (one fp16 ``d``, maybe an fp16 ``m``, then packed codes):

| type | bytes/block | layout                         | decode                    | bpw    |
|------|-------------|--------------------------------|---------------------------|--------|
| Q4_0 | 18          | d, qs[16]                      | x = d * (q - 8)           | 4.5    |
| Q4_1 | 20          | d, m, qs[16]                   | x = d * q + m             | 5.0    |
| Q5_0 | 22          | d, qh[4], qs[16]               | x = d * (q - 16)          | 5.5    |
| Q5_1 | 24          | d, m, qh[4], qs[16]            | x = d * q + m             | 6.0    |
| Q8_0 | 34          | d, qs[32] (int8)               | x = d * q                 | 8.5    |

K-quants: super-blocks of 256 elements with quantized sub-block scales (see
``gguf_kquants``): Q2_K 84 B (2.625 bpw), Q3_K 110 B (3.4375), Q4_K 144 B (4.5),
Q5_K 176 B (5.5), Q6_K 210 B (6.5625).

Non-linear 4-bit (``gguf_iquants``): IQ4_NL 18 B per 32 (4.5 bpw) and IQ4_XS 136 B per
256 (4.25 bpw), indices into a fixed 16-level table. They are registered in
``GGUF_IQ_TYPES`` (``gguf_type``, ``quantize_gguf``, ``dequantize_gguf`` and
``quantize(x, "IQ4_XS")`` take them), not in ``GGUF_TYPES``, the ten types with an integer
grid that the Triton kernels also decode; the CPU kernels (``KERNEL_TYPES``), the loader
and the IQ4_NL / IQ4_XS file types take them too.

Blocks run along the last dimension, which must be a multiple of the block size. The
quantizers write the bytes llama.cpp's reference quantizers write (``quantize_row_*_ref``,
or with an importance matrix ``quantize_<type>(..., quant_weights)``): the same float32
operations in the same order. The legacy ones therefore also equal the ``gguf`` Python
package's quantizer. Every dequantizer does the same float32 operations as
``gguf.quants.dequantize``, so both decode our bytes to identical floats. (Checked in
``tests/formats/test_gguf_*.py``: against the gguf package, against SHA-256s of
llama.cpp's output, and against llama.cpp-written blocks of the built-in model.)

The block codecs live in ``gguf_legacy`` (the five above) and ``gguf_kquants``; this
module registers them (``GGUF_TYPES``) and quantizes/dequantizes whole tensors. Reading a
``.gguf`` file's header, checked field by field, is ``gguf_file``.

A QTensor of kind ``"gguf"`` holds the raw blocks as ``codes`` (uint8,
``[rows, bytes_per_row]``) and nothing else, so ``bits_per_element`` is the GGUF bpw.

Example:
    >>> import torch
    >>> from lessmem.formats import quantize
    >>> qt = quantize(torch.randn(4, 256), "Q4_K")
    >>> qt.bits_per_element, tuple(qt.codes.shape)
    (4.5, (4, 144))
    >>> raw = quantize_gguf(torch.randn(2, 64), "q8_0")
    >>> raw.shape, dequantize_gguf(raw, "q8_0", (2, 64)).shape
    ((2, 68), torch.Size([2, 64]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import gguf_iquants as iq
from . import gguf_kquants as kq
from . import gguf_legacy as lg
from .gguf_legacy import fp16_at, row_weights
from .granularity import PerGroup, SuperBlock
from .qtensor import DEQUANTIZERS, QFormat, QTensor

F32 = np.float32


@dataclass(frozen=True)
class GGUFType:
    """One GGUF block type: sizes, ggml type id, nominal bits and its codec."""

    name: str
    ggml_id: int  # GGMLQuantizationType value
    block_size: int
    type_size: int  # bytes per block
    bits: int
    fp16_offsets: tuple[int, ...]  # byte offsets of the fp16 fields in a block
    quantize_blocks: Callable[..., np.ndarray]  # ([N, block_size] f32[, qw]) -> [N, type_size] u8
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]  # [N, type_size] u8 -> [N, block_size] f32

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size


GGUF_TYPES: dict[str, GGUFType] = {
    t.name: t
    for t in (
        GGUFType("q4_0", 2, 32, 18, 4, (0,), lg.quantize_q4_0, lg.dequantize_q4_0),
        GGUFType("q4_1", 3, 32, 20, 4, (0, 2), lg.quantize_q4_1, lg.dequantize_q4_1),
        GGUFType("q5_0", 6, 32, 22, 5, (0,), lg.quantize_q5_0, lg.dequantize_q5_0),
        GGUFType("q5_1", 7, 32, 24, 5, (0, 2), lg.quantize_q5_1, lg.dequantize_q5_1),
        GGUFType("q8_0", 8, 32, 34, 8, (0,), lg.quantize_q8_0, lg.dequantize_q8_0),
        GGUFType("q2_k", 10, 256, 84, 2, (80, 82), kq.quantize_q2_k, kq.dequantize_q2_k),
        GGUFType("q3_k", 11, 256, 110, 3, (108,), kq.quantize_q3_k, kq.dequantize_q3_k),
        GGUFType("q4_k", 12, 256, 144, 4, (0, 2), kq.quantize_q4_k, kq.dequantize_q4_k),
        GGUFType("q5_k", 13, 256, 176, 5, (0, 2), kq.quantize_q5_k, kq.dequantize_q5_k),
        GGUFType("q6_k", 14, 256, 210, 6, (208,), kq.quantize_q6_k, kq.dequantize_q6_k),
    )
}

# The non-linear types (``gguf_iquants``): ``gguf_type``, ``quantize_gguf``,
# ``dequantize_gguf`` and ``quantize(x, "IQ4_NL")`` know them; kept out of ``GGUF_TYPES``
# (the Triton kernels do not decode them: CUDA takes the torch fallback for them).
GGUF_IQ_TYPES: dict[str, GGUFType] = {
    t.name: t
    for t in (
        GGUFType("iq4_nl", 20, 32, 18, 4, (0,), iq.quantize_iq4_nl, iq.dequantize_iq4_nl),
        GGUFType("iq4_xs", 23, 256, 136, 4, (0,), iq.quantize_iq4_xs, iq.dequantize_iq4_xs),
    )
}
_ALL_TYPES: dict[str, GGUFType] = {**GGUF_TYPES, **GGUF_IQ_TYPES}


def gguf_type(qtype) -> GGUFType:
    """Look up a GGUF type by name ("Q4_K", "q4_k"), ggml id (12) or enum with ``.name``.

    Example:
        >>> gguf_type("Q6_K").bits_per_weight
        6.5625
    """
    if isinstance(qtype, GGUFType):
        return qtype
    key = qtype
    if not isinstance(qtype, (str, int)) and hasattr(qtype, "name"):
        key = qtype.name
    if isinstance(key, str) and key.lower() in _ALL_TYPES:
        return _ALL_TYPES[key.lower()]
    if isinstance(key, int) and not isinstance(key, bool):
        for t in _ALL_TYPES.values():
            if t.ggml_id == key:
                return t
    allowed = ", ".join(t.upper() for t in _ALL_TYPES)
    raise ValueError(f"GGUF type {qtype!r} is not supported; allowed: {allowed}")


def _as_rows(x, t: GGUFType) -> np.ndarray:
    """Validate x and view it as float32 blocks [N, block_size] (numpy, no copy if possible)."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"x has dtype {x.dtype}; quantization needs a floating tensor "
                             "(float16, bfloat16, float32 or float64)")
        x = x.detach().to("cpu", torch.float32).contiguous().numpy()
    elif isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"x has dtype {x.dtype}; GGUF quantization needs a floating array")
        x = np.ascontiguousarray(x, dtype=F32)
    else:
        raise ValueError(f"x must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] % t.block_size:
        raise ValueError(
            f"shape {tuple(x.shape)}: the last dimension must be a multiple of the "
            f"{t.name.upper()} block size {t.block_size}"
        )
    if x.size == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); nothing to quantize")
    if not np.isfinite(x).all():  # numpy: ~100x faster than torch.isfinite on a busy CPU
        raise ValueError(
            f"x holds non-finite values ({int(np.isnan(x).sum())} NaN, {int(np.isinf(x).sum())} inf); "
            "only finite values can be quantized"
        )
    return x.reshape(-1, t.block_size)


_CHUNK_ELEMENTS = 65536


def _as_imatrix(imatrix, n: int) -> np.ndarray:
    if isinstance(imatrix, torch.Tensor):
        imatrix = imatrix.detach().cpu().numpy()
    w = np.asarray(imatrix)
    if not np.issubdtype(w.dtype, np.floating) or w.shape != (n,):
        raise ValueError(
            f"imatrix must be a 1-D float array with one weight per column ({n}); "
            f"got dtype {w.dtype} and shape {w.shape}"
        )
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("imatrix must hold finite, non-negative weights (mean squared activations)")
    return w.astype(F32)


def quantize_gguf(x, qtype, imatrix=None) -> np.ndarray:
    """Quantize ``x`` to GGUF blocks; returns the raw bytes, shape ``[*x.shape[:-1], row_bytes]``.

    This is what a GGUF file stores for the tensor (``gguf.quants.quantize`` gives the
    same array for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0; the K-quants give llama.cpp's bytes).

    ``imatrix``: one non-negative importance weight per column, e.g. the mean squared
    input activation of each input feature of a linear layer, as ``llama-quantize
    --imatrix`` uses it: the scale searches then minimise the weighted error (llama.cpp's
    ``quantize_qN(..., quant_weights)``; Q8_0 ignores it, as llama.cpp does).

    Example:
        >>> import torch
        >>> quantize_gguf(torch.zeros(3, 512), "Q6_K").shape
        (3, 420)
        >>> w = torch.randn(4, 256)
        >>> quantize_gguf(w, "q4_k", imatrix=torch.rand(256)).shape
        (4, 144)
    """
    t = gguf_type(qtype)
    rows = _as_rows(x, t)
    qw = None
    if imatrix is not None:
        n = int(x.shape[-1])
        w = _as_imatrix(imatrix, n)
        if t.block_size == 256 or t.name in GGUF_IQ_TYPES:  # weights formed per (super-)block
            qw = np.broadcast_to(w, (rows.size // n, n)).reshape(rows.shape)
        elif t.name != "q8_0":  # legacy: per row; Q8_0 has no weighted variant (as llama.cpp)
            qw = row_weights(rows.reshape(-1, n), w).reshape(rows.shape)
    # chunks of 64K elements keep the K-quant searches' working set in cache (~1.7x)
    step = max(1, _CHUNK_ELEMENTS // t.block_size)
    parts = []
    for i in range(0, rows.shape[0], step):
        args = (rows[i:i + step],) if qw is None else (rows[i:i + step], qw[i:i + step])
        parts.append(t.quantize_blocks(*args))
    raw = np.concatenate(parts)
    bad = [o for o in t.fp16_offsets if not np.isfinite(fp16_at(raw, o)).all()]
    if bad:
        amax = float(np.abs(rows).max())
        raise ValueError(
            f"values up to |x| = {amax:.4g} overflow the fp16 block scales of "
            f"{t.name.upper()}; scale the tensor down (fp16 max is 65504)"
        )
    shape = tuple(x.shape)
    return raw.reshape(*shape[:-1], shape[-1] // t.block_size * t.type_size)


def dequantize_gguf(raw, qtype, shape) -> torch.Tensor:
    """Decode raw GGUF blocks (ndarray, bytes or uint8 tensor) to a float32 tensor of ``shape``.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 32)
        >>> y = dequantize_gguf(quantize_gguf(x, "q8_0"), "q8_0", x.shape)
        >>> bool((x - y).abs().max() < 0.05)
        True
    """
    t = gguf_type(qtype)
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().numpy()
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if not isinstance(raw, np.ndarray):
        raise ValueError(f"raw must be a numpy array, bytes or torch tensor, got {type(raw).__name__}")
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape)) if shape else 1
    if not shape or shape[-1] % t.block_size:
        raise ValueError(
            f"shape {shape}: the last dimension must be a multiple of the "
            f"{t.name.upper()} block size {t.block_size}"
        )
    want = numel // t.block_size * t.type_size
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if flat.size != want:
        raise ValueError(
            f"raw holds {flat.size} bytes but shape {shape} in {t.name.upper()} needs {want} "
            f"({numel // t.block_size} blocks of {t.type_size} bytes)"
        )
    out = t.dequantize_blocks(flat.reshape(-1, t.type_size))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=F32)).reshape(shape)


# K-quant sub-block size and sub-scale bits (the QTensor's granularity descriptor)
_K_SUBBLOCKS = {"q2_k": (16, 4), "q3_k": (16, 6), "q4_k": (32, 6), "q5_k": (32, 6), "q6_k": (16, 8),
                "iq4_xs": (32, 6)}
_SYMMETRIC = ("q4_0", "q5_0", "q8_0", "q3_k", "q6_k", "iq4_nl", "iq4_xs")  # no min / zero point stored


def quantize_gguf_qtensor(x, qtype, **options) -> QTensor:
    """``quantize(x, "q4_k"[, imatrix=w])``: a QTensor of kind "gguf" holding only the raw blocks.

    Example:
        >>> import torch
        >>> quantize_gguf_qtensor(torch.randn(2, 256), "q2_k").bits_per_element
        2.625
    """
    t = gguf_type(qtype)
    imatrix = options.pop("imatrix", None)
    if options:
        raise ValueError(
            f"GGUF format {t.name.upper()} has a fixed layout and takes no options but "
            f"imatrix; got {', '.join(sorted(options))}"
        )
    raw = quantize_gguf(x, t, imatrix=imatrix)
    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
    sub, sub_bits = _K_SUBBLOCKS.get(t.name, (None, None))
    gran = PerGroup(32) if sub is None else SuperBlock(256, sub, sub_scale_bits=sub_bits)
    fmt = QFormat(kind="gguf", bits=t.bits, granularity=gran, symmetric=t.name in _SYMMETRIC,
                  variant=t.name)
    return QTensor(
        codes=torch.from_numpy(np.ascontiguousarray(rows)),
        scale=None,
        zero_point=None,
        fmt=fmt,
        shape=tuple(x.shape),
        dtype=x.dtype if isinstance(x, torch.Tensor) else torch.float32,
    )


def _dequantize_qtensor(qt: QTensor) -> torch.Tensor:
    return dequantize_gguf(qt.codes, qt.fmt.variant, qt.shape)


DEQUANTIZERS["gguf"] = _dequantize_qtensor

# regex for formats.QUANTIZERS: every GGUF type name
GGUF_PATTERN = "|".join(_ALL_TYPES)

__all__ = ["GGUF_TYPES", "GGUF_IQ_TYPES", "GGUFType", "gguf_type", "quantize_gguf", "dequantize_gguf", "quantize_gguf_qtensor"]
