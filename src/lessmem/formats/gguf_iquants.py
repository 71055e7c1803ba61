"""GGUF's 4-bit non-linear block codecs IQ4_NL and IQ4_XS, byte-exact with llama.cpp.

Both store 4-bit indices into one fixed, non-uniform table of 16 signed int8 levels
(``kvalues_iq4nl`` in llama.cpp's ``ggml-common.h``)::

    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

denser near zero and sparser in the tails, which suits bell-shaped weights better than
the evenly spaced levels of Q4_0. A weight decodes as ``x = scale * kvalues_iq4nl[q]``.

| type   | ggml id | block | bytes | layout                                        | bpw  |
|--------|---------|-------|-------|-----------------------------------------------|------|
| IQ4_NL | 20      | 32    | 18    | d (fp16), qs[16]                              | 4.5  |
| IQ4_XS | 23      | 256   | 136   | d (fp16), scales_h (u16), scales_l[4], qs[128] | 4.25 |

``qs`` packs 32 indices per 16 bytes: element j in the low nibble of byte j, element
j + 16 in the high nibble (the Q4_0 packing), for each run of 32 elements. IQ4_NL's scale
is ``d``. IQ4_XS has 8 sub-blocks of 32, each with a 6-bit scale ``ls`` (low 4 bits in
nibble ``ib % 2`` of ``scales_l[ib // 2]``, high 2 bits at bits ``2 ib`` of ``scales_h``)
and scale ``d * (ls - 32)``. The bits per weight are the honest storage cost: 4 bits of
index plus 16 bits of fp16 per 32 (IQ4_NL), or plus (16 + 16 + 32) bits of super-block
header per 256 (IQ4_XS: 6 bits of scale per sub-block and one fp16).

The encoder is llama.cpp's ``quantize_row_iq4_nl_impl`` (``ggml-quants.c``, used by
``quantize_iq4_nl`` and ``quantize_iq4_xs`` with ``ntry = 7``), in words:

1. per element weight: with an importance matrix ``qw * sqrt(sigma2 + x^2)`` where
   ``sigma2 = 2 / S * sum(x^2)`` over the (super-)block of S = 32 (IQ4_NL) or 256
   (IQ4_XS) elements, else ``x^2``;
2. per block of 32: ``max`` = the signed value of largest magnitude (first one); blocks
   with ``|max| < 1e-15`` get scale 0. Start from ``d = max / 127``, map each x to the
   nearest table level of ``x / d`` (``best_index_int8``: nearest value, ties to the
   upper one), and fit ``d = sum(w q x) / sum(w q^2)``; then try the 15 inverse scales
   ``(t - 127) / max``, t = -7..7, keeping the fit that maximises
   ``(sum w q x)^2 / sum w q^2`` (strictly larger wins);
3. IQ4_NL: ``d`` to fp16, then re-map every x with ``1 / d`` (the float32 ``d``);
   IQ4_XS: the super-block scale is ``-s / 32`` with s the signed largest sub-block scale,
   each sub-block scale becomes ``round_half_even(s_ib / d)`` clamped to [-32, 31], and
   each sub-block is re-mapped with ``1 / (d * l)`` (all in float32, before fp16).

Every float32 operation happens in the C order (sums left to right over the block), so
the bytes equal llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs`` (with and without
``quant_weights``), and the decoders do ``gguf.quants.dequantize``'s float32 operations.
Checked in ``tests/formats/test_gguf_iquants.py`` against SHA-256s of llama.cpp's output.

References: IQ4_NL and IQ4_XS by Iwan Kawrakow (llama.cpp, February 2024):
``quantize_row_iq4_nl_impl``, ``quantize_iq4_nl``, ``quantize_iq4_xs`` and
``dequantize_row_iq4_*`` in ``ggml/src/ggml-quants.c``, the block structs and the table
``kvalues_iq4nl`` in ``ggml/src/ggml-common.h`` (as vendored in llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import numpy as np

from .gguf_search import GROUP_MAX_EPS, _rint, _seqsum

F32 = np.float32

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
_V = KVALUES_IQ4NL.astype(F32)
_MIDS2 = KVALUES_IQ4NL[:-1].astype(np.int32) + KVALUES_IQ4NL[1:]  # twice the midpoints
_LUT_LO, _LUT_HI = int(_MIDS2[0]) - 1, int(_MIDS2[-1])
# index of the nearest level for floor(2a) = k: how many doubled midpoints are <= k
_LUT = np.searchsorted(_MIDS2, np.arange(_LUT_LO, _LUT_HI + 1), side="right").astype(np.uint8)
_NTRY = 7


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """[N] float32 -> [N, 2] little-endian fp16 bytes (round to nearest even)."""
    with np.errstate(over="ignore"):  # overflow is reported by quantize_gguf
        return np.ascontiguousarray(v, dtype=F32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _fp16_at(r: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(r[:, off:off + 2]).view(np.float16).astype(F32)


def _best_index(a: np.ndarray) -> np.ndarray:
    """llama.cpp ``best_index_int8(16, kvalues_iq4nl, a)``: index of the nearest level.

    C brackets ``lo <= a < hi`` and takes the lower level iff ``a - lo < hi - a`` in
    float32 (ties go up; below/above the table: 0 / 15). That is ``a < m = (lo + hi) / 2``
    exactly: the midpoints are halves of integers with ``|m| >= 4.5`` and half-gaps <= 12,
    so for ``a`` near ``m`` both differences are exact, and away from ``m`` rounding
    cannot swap their order. With ``2m`` an integer, ``a < m`` iff ``floor(2a) < 2m``, so
    the index is a table lookup at ``floor(2a)`` (about 4x faster than a binary search).
    """
    with np.errstate(over="ignore", invalid="ignore"):  # |a| near float max: clipped anyway
        k = np.clip(np.floor(a * F32(2)), F32(_LUT_LO), F32(_LUT_HI)).astype(np.int32)
    return _LUT[k - _LUT_LO]


def _inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)


def _fit(xt: np.ndarray, wt: np.ndarray, inv: np.ndarray):
    """Codes of ``inv * x`` and their weighted sums (sum w q x, sum w q^2), C order.

    xt, wt: [32, S] (column-major blocks), inv: [S]."""
    q = _V[_best_index(inv * xt)]
    wq = wt * q
    return _seqsum(wq * xt), _seqsum(wq * q)


def _block_scales(xt: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """The weighted scale search of step 2 for blocks of 32: xt, wt [32, S] -> scales [S]."""
    with np.errstate(over="ignore"):  # huge inputs overflow as in C; fp16 d reports it
        return _block_scales_(xt, wt)


def _block_scales_(xt: np.ndarray, wt: np.ndarray) -> np.ndarray:
    ax = np.abs(xt)
    first = ax.argmax(axis=0)
    cols = np.arange(xt.shape[1])
    amax, mx = ax[first, cols], xt[first, cols]
    small = amax < GROUP_MAX_EPS
    mx_safe = np.where(small, F32(1), mx).astype(F32)  # small blocks: scale 0, no division by 0
    d = -mx_safe / _V[0]
    sumqx, sumq2 = _fit(xt, wt, F32(1) / d)
    pos = sumq2 > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(pos, sumqx / np.where(pos, sumq2, F32(1)), F32(0)).astype(F32)
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        inv = F32(itry + int(KVALUES_IQ4NL[0])) / mx_safe
        sumqx, sumq2 = _fit(xt, wt, inv)
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        if take.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                dn = sumqx / np.where(take, sumq2, F32(1))
            d = np.where(take, dn, d).astype(F32)
            best = np.where(take, d * sumqx, best).astype(F32)
    return np.where(small, F32(0), d).astype(F32)


def _weights(b: np.ndarray, qw) -> np.ndarray:
    """Step 1 on super-blocks b [N, S] (qw: [N, S] importance or None) -> [N, S] float32."""
    if qw is None:
        return b * b
    sigma2 = np.cumsum(b * b, axis=1, dtype=F32)[:, -1:] * F32(2.0 / b.shape[1])  # C order
    return (qw.astype(F32) * np.sqrt(sigma2 + b * b)).astype(F32)


def _pack_nibbles(L: np.ndarray) -> np.ndarray:
    """[N, 32k] codes -> [N, 16k] bytes, per run of 32: j low nibble, j + 16 high nibble."""
    n = L.shape[0]
    r = L.reshape(n, -1, 2, 16)
    return (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(n, -1).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    n = qs.shape[0]
    r = qs.reshape(n, -1, 1, 16)
    return np.concatenate([r & 0x0F, r >> 4], axis=2).reshape(n, -1)


def quantize_iq4_nl(b: np.ndarray, qw=None) -> np.ndarray:
    """IQ4_NL blocks: float32 [N, 32] (importance [N, 32] or None) -> [N, 18] uint8."""
    b = np.ascontiguousarray(b, dtype=F32)
    w = _weights(b, qw)
    xt, wt = np.ascontiguousarray(b.T), np.ascontiguousarray(w.T)
    d = _block_scales(xt, wt)
    L = _best_index(_inv(d) * xt).T
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(L)], axis=1)


def quantize_iq4_xs(b: np.ndarray, qw=None) -> np.ndarray:
    """IQ4_XS super-blocks: float32 [N, 256] (importance [N, 256] or None) -> [N, 136] uint8."""
    b = np.ascontiguousarray(b, dtype=F32)
    n = b.shape[0]
    w = _weights(b, qw)
    xt = np.ascontiguousarray(b.reshape(n * 8, 32).T)  # [32, 8N]: sub-block ib of block i at 8i+ib
    wt = np.ascontiguousarray(w.reshape(n * 8, 32).T)
    s = _block_scales(xt, wt).reshape(n, 8)
    first = np.abs(s).argmax(axis=1)
    smax = s[np.arange(n), first]
    smax = np.where(np.abs(smax) > 0, smax, F32(0)).astype(F32)  # C keeps +0 when all are 0
    d = -smax / F32(32)
    ls = np.clip(_rint(_inv(d)[:, None] * s), -32, 31)
    dl = d[:, None] * ls.astype(F32)
    L = _best_index(_inv(dl.reshape(-1)) * xt).T.reshape(n, 256)
    u = (ls + 32).astype(np.uint16)
    scales_l = ((u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    scales_h = scales_h.astype("<u2").reshape(-1, 1).view(np.uint8)
    return np.concatenate([_fp16_bytes(d), scales_h, scales_l, _pack_nibbles(L)], axis=1)


def dequantize_iq4_nl(r: np.ndarray) -> np.ndarray:
    """[N, 18] uint8 -> [N, 32] float32: ``d * kvalues_iq4nl[q]``."""
    return _fp16_at(r, 0) * _V[_unpack_nibbles(r[:, 2:18])]


def scales_iq4_xs(r: np.ndarray) -> np.ndarray:
    """[N, 136] uint8 -> [N, 8] float32: each sub-block's scale ``d * (ls - 32)``."""
    d = _fp16_at(r, 0)
    sh = np.ascontiguousarray(r[:, 2:4]).view("<u2").astype(np.int32)  # [N, 1]
    sl = r[:, 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
    return d * (ls - 32).astype(F32)


def dequantize_iq4_xs(r: np.ndarray) -> np.ndarray:
    """[N, 136] uint8 -> [N, 256] float32: ``d * (ls - 32) * kvalues_iq4nl[q]`` per sub-block."""
    n = r.shape[0]
    dl = scales_iq4_xs(r)  # [N, 8]
    q = _V[_unpack_nibbles(r[:, 8:136])].reshape(n, 8, 32)
    return (dl[:, :, None] * q).reshape(n, 256)
