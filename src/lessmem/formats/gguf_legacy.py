"""The five legacy GGUF block codecs (blocks of 32): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each quantizer maps float32 blocks ``[N, 32]`` (and, optionally, per-element importance
weights of the same shape) to raw block bytes ``[N, type_size]``; each dequantizer maps
the bytes back to float32 ``[N, 32]``. The byte layouts and the decode formulas are in the
table of ``formats.gguf``; the float32 operations follow llama.cpp's reference quantizers
(``quantize_row_q*_ref``) and the ``gguf`` package's dequantizers in the same order, so
the bytes and the decoded floats are identical to theirs. ``formats.gguf`` registers these
functions in ``GGUF_TYPES``; the K-quants live in ``gguf_kquants``.
"""

from __future__ import annotations

import numpy as np

from .gguf_search import make_qkx2, make_qx

F32 = np.float32


# ---------------------------------------------------------------- shared helpers

def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """[N] float32 -> [N, 2] little-endian fp16 bytes (round to nearest even)."""
    with np.errstate(over="ignore"):  # overflow is reported by quantize_gguf
        return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def fp16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """fp16 field at byte ``off`` of each block -> [N, 1] float32."""
    return np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16).astype(F32)


def _safe_inv(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d == 0 (as ggml does)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, F32(0), F32(1) / d).astype(F32)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[N, 32] codes -> [N, 16] bytes: element j in the low nibble of byte j, j+16 high."""
    return ((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)).astype(np.uint8)


def _unnibble(qs: np.ndarray) -> np.ndarray:
    """Inverse of ``_nibbles``: [N, 16] bytes -> [N, 32] codes 0..15 (uint8)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 codes -> 4 bytes: element j at bit j of a little-endian u32."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _unhigh_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little")


def _first_absmax(blocks: np.ndarray) -> np.ndarray:
    """The signed value of largest magnitude per row (first one on ties), [N, 1]."""
    idx = np.abs(blocks).argmax(axis=1)[:, None]
    return np.take_along_axis(blocks, idx, axis=1)


def _codes_trunc(v: np.ndarray, hi: int) -> np.ndarray:
    """C's ``MIN(hi, (uint8_t)(v))`` for v >= 0: truncate toward zero, clip."""
    return np.minimum(np.trunc(v), F32(hi)).astype(np.uint8)


def _round_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero, exactly (v - trunc(v) is exact in float)."""
    t = np.trunc(v)
    frac = np.abs(v - t)
    return np.where(frac >= F32(0.5), t + np.sign(v), t).astype(F32)


# ---------------------------------------------------------------- legacy quantizers
# All arithmetic is float32; the operation order is the gguf package's (and ggml's).

def quantize_q4_0(b: np.ndarray, w=None) -> np.ndarray:
    if w is not None:
        return _q4_0_w(b, w)
    d = _first_absmax(b) / F32(-8)  # the extreme value maps to code 0 (q - 8 = -8)
    q = _codes_trunc(b * _safe_inv(d) + F32(8.5), 15)
    return np.concatenate([_fp16_bytes(d), _nibbles(q)], axis=1)


def quantize_q4_1(b: np.ndarray, w=None) -> np.ndarray:
    if w is not None:
        return _q4_1_w(b, w)
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    d = (hi - lo) / F32(15)
    q = _codes_trunc((b - lo) * _safe_inv(d) + F32(0.5), 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _nibbles(q)], axis=1)


def quantize_q5_0(b: np.ndarray, w=None) -> np.ndarray:
    if w is not None:
        return _q5_0_w(b, w)
    d = _first_absmax(b) / F32(-16)
    q = _codes_trunc(b * _safe_inv(d) + F32(16.5), 31)
    return np.concatenate([_fp16_bytes(d), _high_bits(q), _nibbles(q)], axis=1)


def quantize_q5_1(b: np.ndarray, w=None) -> np.ndarray:
    if w is not None:
        return _q5_1_w(b, w)
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    d = (hi - lo) / F32(31)
    q = _codes_trunc((b - lo) * _safe_inv(d) + F32(0.5), 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _high_bits(q), _nibbles(q)], axis=1)


def quantize_q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True) / F32(127)
    q = _round_away(b * _safe_inv(d)).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


# With an importance matrix llama.cpp (quantize_row_qN_0/1_impl) runs the K-quant
# searches on each block of 32 with weights w = imatrix * sqrt(sigma2 + x^2), sigma2 =
# mean(x^2) over the whole row (computed by quantize_gguf), and keeps the search's codes.

def _q4_0_w(b: np.ndarray, w: np.ndarray) -> np.ndarray:
    d, L = make_qx(b, 8, w)
    return np.concatenate([_fp16_bytes(d), _nibbles(L)], axis=1)


def _q5_0_w(b: np.ndarray, w: np.ndarray) -> np.ndarray:
    d, L = make_qx(b, 16, w)
    return np.concatenate([_fp16_bytes(d), _high_bits(L), _nibbles(L)], axis=1)


def _q4_1_w(b: np.ndarray, w: np.ndarray) -> np.ndarray:
    d, neg_min, L = make_qkx2(b, w, 15, -0.9, 0.05, 36, False)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(-neg_min), _nibbles(L)], axis=1)


def _q5_1_w(b: np.ndarray, w: np.ndarray) -> np.ndarray:
    d, neg_min, L = make_qkx2(b, w, 31, -0.9, 0.05, 36, False)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(-neg_min), _high_bits(L), _nibbles(L)], axis=1)


def row_weights(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """Per-element weights of the legacy weighted quantizers, rows [R, n] -> [R, n]."""
    sigma2 = np.cumsum(rows * rows, axis=1, dtype=F32)[:, -1] / F32(rows.shape[1])  # C order
    return imatrix[None, :] * np.sqrt(sigma2[:, None] + rows * rows)


# ---------------------------------------------------------------- legacy dequantizers

def dequantize_q4_0(r: np.ndarray) -> np.ndarray:
    q = _unnibble(r[:, 2:18]).astype(np.int8) - np.int8(8)
    return fp16_at(r, 0) * q.astype(F32)


def dequantize_q4_1(r: np.ndarray) -> np.ndarray:
    q = _unnibble(r[:, 4:20]).astype(F32)
    return fp16_at(r, 0) * q + fp16_at(r, 2)


def dequantize_q5_0(r: np.ndarray) -> np.ndarray:
    q = (_unnibble(r[:, 6:22]) | (_unhigh_bits(r[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return fp16_at(r, 0) * q.astype(F32)


def dequantize_q5_1(r: np.ndarray) -> np.ndarray:
    q = (_unnibble(r[:, 8:24]) | (_unhigh_bits(r[:, 4:8]) << 4)).astype(F32)
    return fp16_at(r, 0) * q + fp16_at(r, 2)


def dequantize_q8_0(r: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(r[:, 2:34]).view(np.int8).astype(F32)
    return q * fp16_at(r, 0)
