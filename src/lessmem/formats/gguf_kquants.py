"""GGUF K-quants (Q2_K … Q6_K): super-blocks of 256 with quantized sub-block scales.

Without an importance matrix the quantizers are llama.cpp's ``quantize_row_qN_K_ref``
(what ``llama-quantize`` runs without ``--imatrix``); with one (``qw``, a weight per
column) they are its ``quantize_row_qN_K_impl``. Both are step for step in float32,
vectorized over all sub-blocks at once; the searches live in ``gguf_search``.

Each quantizer has a front half (search each sub-block's scale/min and codes, then
quantize those sub-block scales against one fp16 super-block scale: 6-bit for
Q4_K/Q5_K, 4-bit for Q2_K, 6-bit signed for Q3_K, int8 for Q6_K) and a shared back half
(recompute the codes against the *stored* scales, pack the bytes).

Byte layouts (per 256 elements):
  Q2_K  scales[16] (lo nibble scale, hi nibble min) | qs[64] 2-bit | d | dmin     84 B
  Q3_K  hmask[32] | qs[64] 2-bit | scales[12] 6-bit | d                           110 B
  Q4_K  d | dmin | scales[12] 6-bit scale+min | qs[128] 4-bit                     144 B
  Q5_K  d | dmin | scales[12] | qh[32] | qs[128]                                  176 B
  Q6_K  ql[128] | qh[64] | scales[16] int8 | d                                    210 B
"""

from __future__ import annotations

import numpy as np

from .gguf_legacy import _fp16_bytes
from .gguf_legacy import fp16_at as _fp16_at
from .gguf_search import GROUP_MAX_EPS, _rint, _seqsum, make_q3, make_qkx2, make_qp, make_qx

F32 = np.float32
QK_K = 256


def _fp16(v: np.ndarray) -> np.ndarray:
    """Round float32 to fp16 and back (the stored value)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype(F32)


def _first_absmax(x: np.ndarray):
    """(signed value, magnitude) of the first largest |x| per row."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(x, idx, axis=-1)[..., 0]
    return mx, np.abs(mx)


# ---------------------------------------------------------------- packing helpers

def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """[N, 256] codes 0..3 -> [N, 64]: byte 32h + l holds L[128h + l + 32k] at bits 2k."""
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shift) & 3).reshape(-1, QK_K)


def _nibbles_k(L: np.ndarray) -> np.ndarray:
    """[N, 256] codes -> [N, 128]: each 64-element chunk's first 32 in low nibbles, next 32 high."""
    q = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    return ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """[N, 256] 0/1 -> [N, 32]: byte j holds element 32k + j at bit k (Q3_K hmask, Q5_K qh)."""
    hb = bits.astype(np.uint8).reshape(-1, 8, 32)
    out = np.zeros((hb.shape[0], 32), dtype=np.uint8)
    for k in range(8):
        out |= hb[:, k] << k
    return out


def _unbit_planes(b: np.ndarray) -> np.ndarray:
    return ((b[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, QK_K)


def codes_q3_k(L: np.ndarray) -> np.ndarray:
    """Codes 0..7 [N, 256] -> bytes 0:96 of Q3_K (hmask: bit 2; qs: bits 0-1)."""
    return np.concatenate([_bit_planes(L > 3), _pack_2bit(L & 3)], axis=1)


def codes_q4_k(L: np.ndarray) -> np.ndarray:
    """Codes 0..15 -> bytes 16:144 of Q4_K."""
    return _nibbles_k(L)


def codes_q5_k(L: np.ndarray) -> np.ndarray:
    """Codes 0..31 -> bytes 16:176 of Q5_K (qh: bit 4; qs: nibbles)."""
    return np.concatenate([_bit_planes(L >> 4), _nibbles_k(L)], axis=1)


def codes_q6_k(L: np.ndarray) -> np.ndarray:
    """Codes 0..63 -> bytes 0:192 of Q6_K (ql: low nibbles; qh: 2 high bits)."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)  # per 128: quarters q1..q4
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=2).reshape(-1, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh], axis=1)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> 12 bytes (ggml ``get_scale_min_k4`` layout)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def _unpack_scale_min_k4(s: np.ndarray):
    """12 bytes -> (scales [N, 8], mins [N, 8]) as uint8."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _pack_q3_scales(l6: np.ndarray) -> np.ndarray:
    """16 six-bit values -> 12 bytes: low nibbles in bytes 0-7, high 2 bits in 8-11."""
    l6 = l6.astype(np.uint8)
    out = np.zeros((l6.shape[0], 12), dtype=np.uint8)
    out[:, :8] = (l6[:, :8] & 0x0F) | ((l6[:, 8:] & 0x0F) << 4)
    hi = (l6 >> 4).reshape(-1, 4, 4)  # j = 4*g + k  -> byte 8 + k, bits 2g
    out[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return out


def _unpack_q3_scales(s: np.ndarray) -> np.ndarray:
    lo = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=1)
    hi = (s[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    return lo | (hi.reshape(-1, 16) << 4)


def _requant(x, d, m, lo, hi, L):
    """Codes against the stored sub-block scales; sub-blocks with d == 0 keep L."""
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (x + m[..., None]) / d[..., None] if m is not None else x / d[..., None]
        new = np.clip(_rint(np.where(d[..., None] != 0, v, F32(0))), lo, hi)
    return np.where(d[..., None] != 0, new, L)


# ---------------------------------------------------------------- quantizers

def _sub(b: np.ndarray, sub: int) -> np.ndarray:
    """[N, 256] -> [N * 256/sub, sub] sub-block rows."""
    return b.reshape(-1, sub)


def _col_sum(a: np.ndarray) -> np.ndarray:
    """C-order sum of each row of a [S, n] -> [S]."""
    return _seqsum(np.ascontiguousarray(a.T))


def _imatrix_weights(b, qw, sub, sigma_scale):
    """llama.cpp's weights with an importance matrix: qw * sqrt(sigma2 + x^2) per element,
    sigma2 = sigma_scale * mean(x^2) over the super-block; and their per-sub-block sums."""
    sigma2 = (F32(sigma_scale) * _col_sum(b * b)) / F32(QK_K)
    w = qw * np.sqrt(sigma2[:, None] + b * b)
    return _sub(w, sub), _col_sum(_sub(w, sub)).reshape(b.shape[0], -1)


def _avx_weights(xs):
    """Weights without an importance matrix: sqrt(mean(x^2)) + |x| per sub-block."""
    av = np.sqrt(_col_sum(xs * xs) / F32(xs.shape[1]))
    return av[:, None] + np.abs(xs)


def _max0(a: np.ndarray) -> np.ndarray:
    """max(0, max over sub-blocks): the C loop starts at 0 and keeps strictly larger."""
    return np.maximum(a.max(axis=1), F32(0))


def _scales_by_max(v, nmax, store_mask):
    """Sub-block scales (or mins) [N, k] -> (codes, super-block scale): v * nmax / max(v)."""
    vmax = _max0(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(vmax > 0, F32(nmax) / vmax, F32(0)).astype(F32)
    return _rint(inv[:, None] * v) & store_mask, (vmax / F32(nmax)).astype(F32)


def _q45_k(b: np.ndarray, qw, nmax: int, rmin: float, nstep: int, clamp63: bool):
    N = b.shape[0]
    if qw is None:
        xs = _sub(b, 32)
        sc, mn, L = make_qkx2(xs, _avx_weights(xs), nmax, rmin, 0.1, nstep, False)
        sc, mn = sc.reshape(N, 8), mn.reshape(N, 8)
        ls, d_h = _scales_by_max(sc, 63, 0xFF)  # (uint8_t) nearest_int(.)
        lm, m_h = _scales_by_max(mn, 63, 0xFF)
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    else:
        w, sw = _imatrix_weights(b, qw, 32, 2.0)
        sc, mn, L = make_qkx2(_sub(b, 32), w, nmax, -0.9, 0.05, 36, False)
        d_h, ls = make_qp(sc.reshape(N, 8), 63, sw)
        m_h, lm = make_qp(mn.reshape(N, 8), 63, sw)
        if clamp63:  # Q5_K clamps, Q4_K does not
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    scales = _pack_scale_min_k4(ls, lm)
    sc6, mn6 = _unpack_scale_min_k4(scales)
    d = _fp16(d_h)[:, None] * sc6.astype(F32)
    m = _fp16(m_h)[:, None] * mn6.astype(F32)
    L = _requant(b.reshape(N, 8, 32), d, m, 0, nmax, L.reshape(N, 8, 32)).reshape(N, QK_K)
    return np.concatenate([_fp16_bytes(d_h), _fp16_bytes(m_h), scales], axis=1), L


def quantize_q4_k(b: np.ndarray, qw=None) -> np.ndarray:
    """[N, 256] float32 (and optional per-element imatrix weights) -> [N, 144] Q4_K bytes.

    Example:
        >>> b = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
        >>> y = dequantize_q4_k(quantize_q4_k(b))
        >>> y.shape, bool(np.abs(y - b).max() < 0.05)
        ((2, 256), True)
    """
    head, L = _q45_k(b, qw, 15, -1.0, 20, clamp63=False)
    return np.concatenate([head, codes_q4_k(L)], axis=1)


def quantize_q5_k(b: np.ndarray, qw=None) -> np.ndarray:
    """[N, 256] -> [N, 176] Q5_K bytes (as ``quantize_q4_k``, 5-bit codes)."""
    head, L = _q45_k(b, qw, 31, -0.5, 15, clamp63=True)
    return np.concatenate([head, codes_q5_k(L)], axis=1)


def quantize_q2_k(b: np.ndarray, qw=None) -> np.ndarray:
    """[N, 256] -> [N, 84] Q2_K bytes: 16 sub-blocks of 16, 4-bit scales and mins."""
    N = b.shape[0]
    if qw is None:
        xs = _sub(b, 16)
        sc, mn, L = make_qkx2(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        ls, d_h = _scales_by_max(sc.reshape(N, 16), 15, -1)
        lm, m_h = _scales_by_max(mn.reshape(N, 16), 15, -1)
    else:
        w, sw = _imatrix_weights(b, qw, 16, 1.0)
        sc, mn, L = make_qkx2(_sub(b, 16), w, 3, -0.9, 0.05, 36, False)
        d_h, ls = make_qp(sc.reshape(N, 16), 15, sw)
        m_h, lm = make_qp(mn.reshape(N, 16), 15, sw)
    packed = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)  # lo nibble scale, hi nibble min
    d = _fp16(d_h)[:, None] * (packed & 0x0F).astype(F32)
    m = _fp16(m_h)[:, None] * (packed >> 4).astype(F32)
    L = _requant(b.reshape(N, 16, 16), d, m, 0, 3, L.reshape(N, 16, 16)).reshape(N, QK_K)
    return np.concatenate([packed, _pack_2bit(L), _fp16_bytes(d_h), _fp16_bytes(m_h)], axis=1)


def quantize_q3_k(b: np.ndarray, qw=None) -> np.ndarray:
    """[N, 256] -> [N, 110] Q3_K bytes: 16 symmetric sub-blocks of 16, 6-bit scales."""
    N = b.shape[0]
    if qw is None:
        sc, L = make_q3(_sub(b, 16), 4)
        sc = sc.reshape(N, 16)
        max_sc, _ = _first_absmax(sc)
        nz = max_sc != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(nz, F32(-32) / max_sc, F32(0)).astype(F32)
            l8 = ((_rint(iscale[:, None] * sc) + 128) & 0xFF) - 128  # int8_t store
            d_h = np.where(nz, F32(1) / iscale, F32(0)).astype(F32)
        l6 = np.where(nz[:, None], np.clip(l8, -32, 31) + 32, 0)
    else:
        w, sw = _imatrix_weights(b, qw, 16, 2.0)
        sc, L = make_qx(_sub(b, 16), 4, w)
        d_h, l6 = make_qx(sc.reshape(N, 16), 32, sw)  # scales of the scales, 6-bit signed
    scales = _pack_q3_scales(l6)
    d = _fp16(d_h)[:, None] * (_unpack_q3_scales(scales).astype(np.int32) - 32).astype(F32)
    L = _requant(b.reshape(N, 16, 16), d, None, -4, 3, L.reshape(N, 16, 16) - 4) + 4
    return np.concatenate([codes_q3_k(L.reshape(N, QK_K)), scales, _fp16_bytes(d_h)], axis=1)


def quantize_q6_k(b: np.ndarray, qw=None) -> np.ndarray:
    """[N, 256] -> [N, 210] Q6_K bytes: 16 symmetric sub-blocks of 16, int8 scales."""
    N = b.shape[0]
    sc, L = make_qx(_sub(b, 16), 32, None if qw is None else _sub(qw, 16))
    sc, L = sc.reshape(N, 16), L.reshape(N, 16, 16)
    max_sc, amax = _first_absmax(sc)
    zero = ~(amax >= GROUP_MAX_EPS)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_sc).astype(F32)
        d_h = np.where(zero, F32(0), F32(1) / iscale).astype(F32)
    s8 = ((np.minimum(_rint(iscale[:, None] * sc), 127) + 128) & 0xFF) - 128
    s8 = np.where(zero[:, None], 0, s8)
    d = _fp16(d_h)[:, None] * s8.astype(F32)
    L = (_requant(b.reshape(N, 16, 16), d, None, -32, 31, L - 32) + 32).reshape(N, QK_K)
    L = np.where(zero[:, None], 0, L).astype(np.uint8)
    return np.concatenate([codes_q6_k(L), s8.astype(np.int8).view(np.uint8), _fp16_bytes(d_h)], axis=1)


# ---------------------------------------------------------------- dequantizers
# Same float32 operations as gguf.quants / ggml dequantize_row_*: (d*sc)*q - (dmin*m).

def dequantize_q2_k(r: np.ndarray) -> np.ndarray:
    dl, ml = scales_q2_k(r)
    q = _unpack_2bit(r[:, 16:80]).reshape(-1, 16, 16).astype(F32)
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(-1, QK_K)


def uncodes_q3_k(r: np.ndarray) -> np.ndarray:
    """Q3_K bytes -> codes 0..7 [N, 256] (value = scale * (code - 4))."""
    return _unpack_2bit(r[:, 32:96]) | (_unbit_planes(r[:, :32]) << 2)


def uncodes_q4_k(r: np.ndarray) -> np.ndarray:
    return _unnibble_k(r[:, 16:144])


def uncodes_q5_k(r: np.ndarray) -> np.ndarray:
    return _unnibble_k(r[:, 48:176]) | (_unbit_planes(r[:, 16:48]) << 4)


def uncodes_q6_k(r: np.ndarray) -> np.ndarray:
    ql, qh = r[:, :128], r[:, 128:192]
    lo = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    lo = lo.reshape(-1, 2, 4, 32)
    hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return (lo | (hi << 4)).reshape(-1, QK_K)


def scales_q2_k(r: np.ndarray):
    """Per sub-block of 16: (scale, min) [N, 16] float32 as the decoder forms them."""
    sc = r[:, :16]
    return _fp16_at(r, 80) * (sc & 0x0F).astype(F32), _fp16_at(r, 82) * (sc >> 4).astype(F32)


def scales_q3_k(r: np.ndarray) -> np.ndarray:
    sc = (_unpack_q3_scales(r[:, 96:108]).astype(np.int8) - np.int8(32)).astype(F32)
    return _fp16_at(r, 108) * sc


def scales_q45_k(r: np.ndarray):
    """Q4_K/Q5_K: per sub-block of 32, (scale, min) [N, 8]."""
    sc, mn = _unpack_scale_min_k4(r[:, 4:16])
    return _fp16_at(r, 0) * sc.astype(F32), _fp16_at(r, 2) * mn.astype(F32)


def scales_q6_k(r: np.ndarray) -> np.ndarray:
    return _fp16_at(r, 208) * np.ascontiguousarray(r[:, 192:208]).view(np.int8).astype(F32)


def dequantize_q3_k(r: np.ndarray) -> np.ndarray:
    dl = scales_q3_k(r)[:, :, None]
    q = uncodes_q3_k(r).astype(np.int8) - np.int8(4)
    return (dl * q.reshape(-1, 16, 16).astype(F32)).reshape(-1, QK_K)


def _dq45_k(r: np.ndarray, q: np.ndarray) -> np.ndarray:
    d, dm = scales_q45_k(r)
    return (d[:, :, None] * q.reshape(-1, 8, 32).astype(F32) - dm[:, :, None]).reshape(-1, QK_K)


def _unnibble_k(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, QK_K)


def dequantize_q4_k(r: np.ndarray) -> np.ndarray:
    return _dq45_k(r, uncodes_q4_k(r))


def dequantize_q5_k(r: np.ndarray) -> np.ndarray:
    return _dq45_k(r, uncodes_q5_k(r))


def dequantize_q6_k(r: np.ndarray) -> np.ndarray:
    d = scales_q6_k(r)[:, :, None]
    q = uncodes_q6_k(r).astype(np.int8) - np.int8(32)
    return (d * q.reshape(-1, 16, 16).astype(F32)).reshape(-1, QK_K)
