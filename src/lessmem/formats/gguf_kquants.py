"""GGUF K-quants (Q2_K … Q6_K): super-blocks of 256 with quantized sub-block scales.

Quantizers follow llama.cpp's ``quantize_row_qN_K_ref`` (no importance matrix), step
for step in float32, vectorized over all sub-blocks at once. The scale searches:

- ``make_qkx2``: affine x ~ s*L + m (m <= 0, L in [0, nmax]); try ``nstep+1`` trial
  inverse scales (rmin + rdelta*i + nmax) / (max - min), fit (s, m) to each trial's
  codes by weighted least squares, keep the smallest weighted error (Q2_K, Q4_K, Q5_K).
- ``make_q3``: symmetric x ~ s*L, L in [-nmax, nmax-1], start from the extreme value,
  then coordinate descent: move one code at a time when it raises
  (sum w x L)^2 / (sum w L^2) with w = x^2 (Q3_K).
- ``make_qx``: symmetric, weighted least-squares scale for 19 trial inverse scales
  -(nmax + 0.1*i) / max, keep the best (Q6_K).

Sums run left to right (``np.cumsum`` is a sequential accumulate) as C's loops do.
The sub-block scales are then quantized against one fp16 super-block scale (6-bit for
Q4_K/Q5_K, 4-bit for Q2_K, 6-bit signed for Q3_K, int8 for Q6_K) and the codes
recomputed against the *stored* scales.

Byte layouts (per 256 elements):
  Q2_K  scales[16] (lo nibble scale, hi nibble min) | qs[64] 2-bit | d | dmin     84 B
  Q3_K  hmask[32] | qs[64] 2-bit | scales[12] 6-bit | d                           110 B
  Q4_K  d | dmin | scales[12] 6-bit scale+min | qs[128] 4-bit                     144 B
  Q5_K  d | dmin | scales[12] | qh[32] | qs[128]                                  176 B
  Q6_K  ql[128] | qh[64] | scales[16] int8 | d                                    210 B
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 of a column-major [n, S] array (C loop order)."""
    acc = a[0].copy()
    for row in a[1:]:
        acc += row
    return acc


def _rint(v: np.ndarray) -> np.ndarray:
    """ggml ``nearest_int`` as int32, bit for bit.

    Adding 1.5 * 2^23 leaves round-half-even(v) in the low mantissa bits, so for
    |v| <= 2^22 this is ``rint(v)``; outside that range it reproduces ggml's wrap-around
    too (and never hits an undefined float->int cast).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        bits = (np.asarray(v, dtype=F32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _fp16(v: np.ndarray) -> np.ndarray:
    """Round float32 to fp16 and back (the stored value)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype(F32)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow is reported by quantize_gguf
        return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _fp16_at(r: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(r[:, off:off + 2]).view(np.float16).astype(F32)


def _first_absmax(x: np.ndarray):
    """(signed value, magnitude) of the first largest |x| per row."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(x, idx, axis=-1)[..., 0]
    return mx, np.abs(mx)


# ---------------------------------------------------------------- scale searches

# The searches take rows [S, n] but work column-major ([n, S], one row per element
# position) so each step of C's element loop is one contiguous vector operation.

def make_qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """Affine search over rows of x [S, n] with weights w -> (scale [S], -min [S], L [S, n])."""
    x, w = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    flat = hi == lo
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (hi - lo)
        scale = F32(1) / iscale
        L = np.clip(_rint(iscale * (x - lo)), 0, nmax)

        def err(s, m, codes):
            diff = s * codes.astype(F32) + m - x
            diff = np.abs(diff) if use_mad else diff * diff
            return _seqsum(w * diff)

        best = err(scale, lo, L)
        for i in range(nstep + 1):
            # ggml keeps using the best (scale, min) found so far: min moves the grid
            isc = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (hi - lo)
            la = np.clip(_rint(isc * (x - lo)), 0, nmax)
            lf = la.astype(F32)
            wl = w * lf
            sum_l, sum_l2, sum_xl = _seqsum(wl), _seqsum(wl * lf), _seqsum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            # weighted least squares for x ~ s*L + m; m > 0 is not allowed -> m = 0
            this_s = (sum_w * sum_xl - sum_x * sum_l) / D
            this_m = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_m > 0
            this_s = np.where(pos, sum_xl / sum_l2, this_s)
            this_m = np.where(pos, F32(0), this_m)
            cur = err(this_s, this_m, la)
            take = (D > 0) & (cur < best) & ~flat
            L = np.where(take, la, L)
            best = np.where(take, cur, best)
            scale = np.where(take, this_s, scale)
            lo = np.where(take, this_m, lo)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat, 0, L)
    return scale, (-lo).astype(F32), np.ascontiguousarray(L.T)


def _lsq_sums(x, w, lf):
    """(sum w*x*l, sum w*l*l) in C's order, column-major inputs."""
    return _seqsum((w * x) * lf), _seqsum((w * lf) * lf)


def _first_absmax_cols(x):
    """(signed value, magnitude) of the first largest |x| per column of [n, S]."""
    idx = np.abs(x).argmax(axis=0)[None, :]
    mx = np.take_along_axis(x, idx, axis=0)[0]
    return mx, np.abs(mx)


def make_qx(x, nmax):
    """Symmetric weighted search (rmse_type 1, w = x^2) -> (scale [S], L [S, n] in [0, 2*nmax))."""
    x = np.ascontiguousarray(x.T)
    mx, amax = _first_absmax_cols(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-nmax) / mx
        lf = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        L = lf + nmax
        sumlx, suml2 = _lsq_sums(x, w, lf.astype(F32))
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for i in range(-9, 10):
            if i == 0:
                continue
            isc = -(F32(nmax) + F32(0.1) * F32(i)) / mx
            li = np.clip(_rint(isc * x), -nmax, nmax - 1)
            slx, sl2 = _lsq_sums(x, w, li.astype(F32))
            take = (sl2 > 0) & (slx * slx > best * sl2)  # larger (sum w x l)^2 / sum w l^2
            L = np.where(take, li + nmax, L)
            scale = np.where(take, slx / sl2, scale).astype(F32)
            best = np.where(take, scale * slx, best).astype(F32)
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, np.ascontiguousarray(np.where(zero, 0, L).T)


def make_q3(x, nmax):
    """Symmetric search with coordinate descent (do_rmse) -> (scale [S], L [S, n] in [0, 2*nmax))."""
    x = np.ascontiguousarray(x.T)
    n = x.shape[0]
    mx, amax = _first_absmax_cols(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-nmax) / mx
        L = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        sumlx, suml2 = _lsq_sums(x, w, L.astype(F32))
        for _ in range(5):
            # one coordinate at a time, in order; a converged column stays unchanged,
            # so running all 5 passes equals C's early exit
            for i in range(n):
                li = L[i].astype(F32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - (w[i] * li) * li
                new = np.clip(_rint((x[i] * sl2) / slx), -nmax, nmax - 1)
                nf = new.astype(F32)
                slx2 = slx + wx[i] * nf
                sl22 = sl2 + (w[i] * nf) * nf
                ok = (slx > 0) & (new != L[i]) & (sl22 > 0)
                ok &= (slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22
                L[i] = np.where(ok, new, L[i])
                sumlx = np.where(ok, slx2, sumlx)
                suml2 = np.where(ok, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, np.ascontiguousarray(np.where(zero, 0, L + nmax).T)


# ---------------------------------------------------------------- packing helpers

def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """[N, 256] codes 0..3 -> [N, 64]: byte 32h + l holds L[128h + l + 32k] at bits 2k."""
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shift) & 3).reshape(-1, QK_K)


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


def _max0(a: np.ndarray) -> np.ndarray:
    """max(0, max over sub-blocks): the C loop starts at 0 and keeps strictly larger."""
    return np.maximum(a.max(axis=1), F32(0))


# ---------------------------------------------------------------- quantizers

def _qkx_superblock(b, sub, nmax, rmin, rdelta, nstep, use_mad, weights):
    """Shared front half of Q2_K/Q4_K/Q5_K: per-sub-block (scale, min, L)."""
    N = b.shape[0]
    xs = b.reshape(N * (QK_K // sub), sub)
    sc, mn, L = make_qkx2(xs, weights(xs), nmax, rmin, rdelta, nstep, use_mad)
    return xs.reshape(N, -1, sub), sc.reshape(N, -1), mn.reshape(N, -1), L.reshape(N, -1, sub)


def _avx_weights(xs):
    av = np.sqrt(_seqsum(np.ascontiguousarray((xs * xs).T)) / F32(xs.shape[1]))
    return av[:, None] + np.abs(xs)


def _q45_k(b: np.ndarray, nmax: int, rmin: float, nstep: int):
    x, sc, mn, L = _qkx_superblock(b, 32, nmax, rmin, 0.1, nstep, False, _avx_weights)
    max_s, max_m = _max0(sc), _max0(mn)
    with np.errstate(divide="ignore"):
        inv_s = np.where(max_s > 0, F32(63) / max_s, F32(0)).astype(F32)
        inv_m = np.where(max_m > 0, F32(63) / max_m, F32(0)).astype(F32)
    # (uint8_t) nearest_int(...) then MIN(63, .): wrap like C's narrowing store
    ls = np.minimum(_rint(inv_s[:, None] * sc) & 0xFF, 63)
    lm = np.minimum(_rint(inv_m[:, None] * mn) & 0xFF, 63)
    d_h, m_h = max_s / F32(63), max_m / F32(63)
    d = _fp16(d_h)[:, None] * ls.astype(F32)
    m = _fp16(m_h)[:, None] * lm.astype(F32)
    L = _requant(x, d, m, 0, nmax, L).reshape(-1, QK_K)
    head = np.concatenate([_fp16_bytes(d_h), _fp16_bytes(m_h), _pack_scale_min_k4(ls, lm)], axis=1)
    return head, L


def quantize_q4_k(b: np.ndarray) -> np.ndarray:
    head, L = _q45_k(b, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32).astype(np.uint8)  # 64-element chunks: low nibble, high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(b: np.ndarray) -> np.ndarray:
    head, L = _q45_k(b, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    hb = (q >> 4).reshape(-1, 8, 32)  # bit 2c of qh[j] <- L[64c + j], bit 2c+1 <- L[64c + 32 + j]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for k in range(8):
        qh |= hb[:, k] << k
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q2_k(b: np.ndarray) -> np.ndarray:
    x, sc, mn, L = _qkx_superblock(b, 16, 3, -0.5, 0.1, 15, True, np.abs)
    max_s, max_m = _max0(sc), _max0(mn)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(max_s[:, None] > 0, _rint((F32(15) / max_s)[:, None] * sc), 0)
        lm = np.where(max_m[:, None] > 0, _rint((F32(15) / max_m)[:, None] * mn), 0)
    d_h = np.where(max_s > 0, max_s / F32(15), F32(0)).astype(F32)
    m_h = np.where(max_m > 0, max_m / F32(15), F32(0)).astype(F32)
    packed = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)
    d = _fp16(d_h)[:, None] * (packed & 0x0F).astype(F32)
    m = _fp16(m_h)[:, None] * (packed >> 4).astype(F32)
    L = _requant(x, d, m, 0, 3, L).reshape(-1, QK_K)
    return np.concatenate([packed, _pack_2bit(L), _fp16_bytes(d_h), _fp16_bytes(m_h)], axis=1)


def quantize_q3_k(b: np.ndarray) -> np.ndarray:
    N = b.shape[0]
    xs = b.reshape(N * 16, 16)
    sc, L = make_q3(xs, 4)
    x, sc, L = xs.reshape(N, 16, 16), sc.reshape(N, 16), L.reshape(N, 16, 16)
    max_sc, _ = _first_absmax(sc)
    nz = max_sc != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(nz, F32(-32) / max_sc, F32(0)).astype(F32)
        l8 = ((_rint(iscale[:, None] * sc) + 128) & 0xFF) - 128  # int8_t store
        d_h = np.where(nz, F32(1) / iscale, F32(0)).astype(F32)
    l6 = np.where(nz[:, None], np.clip(l8, -32, 31) + 32, 0)
    scales = _pack_q3_scales(l6)
    d = _fp16(d_h)[:, None] * (_unpack_q3_scales(scales).astype(np.int32) - 32).astype(F32)
    L = _requant(x, d, None, -4, 3, L - 4) + 4
    L = L.reshape(N, QK_K)
    # hmask[m] bit k <- (L[32k + m] > 3); the low 2 bits go to qs
    hb = (L > 3).astype(np.uint8).reshape(N, 8, 32)
    hmask = np.zeros((N, 32), dtype=np.uint8)
    for k in range(8):
        hmask |= hb[:, k] << k
    return np.concatenate([hmask, _pack_2bit(L & 3), scales, _fp16_bytes(d_h)], axis=1)


def quantize_q6_k(b: np.ndarray) -> np.ndarray:
    N = b.shape[0]
    xs = b.reshape(N * 16, 16)
    sc, L = make_qx(xs, 32)
    x, sc, L = xs.reshape(N, 16, 16), sc.reshape(N, 16), L.reshape(N, 16, 16)
    max_sc, amax = _first_absmax(sc)
    zero = ~(amax >= GROUP_MAX_EPS)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_sc).astype(F32)
        d_h = np.where(zero, F32(0), F32(1) / iscale).astype(F32)
    s8 = ((np.minimum(_rint(iscale[:, None] * sc), 127) + 128) & 0xFF) - 128
    s8 = np.where(zero[:, None], 0, s8)
    d = _fp16(d_h)[:, None] * s8.astype(F32)
    L = (_requant(x, d, None, -32, 31, L - 32) + 32).reshape(N, QK_K)
    L = np.where(zero[:, None], 0, L).astype(np.uint8)
    q = L.reshape(N, 2, 4, 32)  # per 128: quarters q1..q4
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=2).reshape(N, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(N, 64)
    return np.concatenate([ql, qh, s8.astype(np.int8).view(np.uint8), _fp16_bytes(d_h)], axis=1)


# ---------------------------------------------------------------- dequantizers
# Same float32 operations as gguf.quants / ggml dequantize_row_*: (d*sc)*q - (dmin*m).

def dequantize_q2_k(r: np.ndarray) -> np.ndarray:
    sc = r[:, :16]
    dl = (_fp16_at(r, 80) * (sc & 0x0F).astype(F32))[:, :, None]
    ml = (_fp16_at(r, 82) * (sc >> 4).astype(F32))[:, :, None]
    q = _unpack_2bit(r[:, 16:80]).reshape(-1, 16, 16).astype(F32)
    return (dl * q - ml).reshape(-1, QK_K)


def dequantize_q3_k(r: np.ndarray) -> np.ndarray:
    sc = (_unpack_q3_scales(r[:, 96:108]).astype(np.int8) - np.int8(32)).astype(F32)
    dl = (_fp16_at(r, 108) * sc)[:, :, None]
    hm = r[:, :32]
    hbit = ((hm[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, QK_K)
    q = _unpack_2bit(r[:, 32:96]).astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(-1, 16, 16).astype(F32)).reshape(-1, QK_K)


def _dq45_k(r: np.ndarray, q: np.ndarray) -> np.ndarray:
    sc, mn = _unpack_scale_min_k4(r[:, 4:16])
    d = (_fp16_at(r, 0) * sc.astype(F32))[:, :, None]
    dm = (_fp16_at(r, 2) * mn.astype(F32))[:, :, None]
    return (d * q.reshape(-1, 8, 32).astype(F32) - dm).reshape(-1, QK_K)


def _unnibble_k(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, QK_K)


def dequantize_q4_k(r: np.ndarray) -> np.ndarray:
    return _dq45_k(r, _unnibble_k(r[:, 16:144]))


def dequantize_q5_k(r: np.ndarray) -> np.ndarray:
    qh = r[:, 16:48]
    hbit = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, QK_K)
    return _dq45_k(r, _unnibble_k(r[:, 48:176]) | (hbit << 4))


def dequantize_q6_k(r: np.ndarray) -> np.ndarray:
    ql, qh = r[:, :128], r[:, 128:192]
    sc = np.ascontiguousarray(r[:, 192:208]).view(np.int8).astype(F32)
    d = (_fp16_at(r, 208) * sc)[:, :, None]
    lo = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    lo = lo.reshape(-1, 2, 4, 32)
    hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    return (d * q.reshape(-1, 16, 16).astype(F32)).reshape(-1, QK_K)
