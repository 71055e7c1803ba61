"""Slow, obviously-correct twins of the GGUF quantizers, for tests only.

One block at a time, one element at a time, every value an ``np.float32`` scalar, in
the order of llama.cpp's C loops (``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``,
``quantize_row_q4_1_ref``, ``quantize_row_q4_K_ref``). The fast vectorized paths in
``gguf_legacy.py`` / ``gguf_kquants.py`` must produce the same bytes.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def _nearest_int(f) -> int:
    """ggml's nearest_int: the low mantissa bits of f + 1.5 * 2^23."""
    val = np.array(F32(f) + F32(12582912.0), dtype=F32)
    return (int(val.view(np.int32)) & 0x007FFFFF) - 0x00400000


def _fp16(v) -> bytes:
    return np.array(F32(v), dtype=np.float16).tobytes()


def _fp16_value(v) -> np.float32:
    return F32(np.float16(F32(v)))


def _blocks(row: np.ndarray, size: int):
    row = np.asarray(row, dtype=F32).reshape(-1)
    for b in range(row.size // size):
        yield [F32(v) for v in row[b * size:(b + 1) * size]]


def quantize_q8_0_reference(row: np.ndarray) -> bytes:
    """d = amax / 127; q = roundf(x / d) (half away from zero)."""
    out = bytearray()
    for x in _blocks(row, 32):
        amax = F32(0)
        for v in x:
            amax = max(amax, F32(abs(v)))
        d = amax / F32(127)
        inv = F32(1) / d if d != 0 else F32(0)
        out += _fp16(d)
        for v in x:
            p = float(v * inv)  # exact float32 value as a Python float
            q = math.floor(abs(p) + 0.5) * (1 if p >= 0 else -1)  # float64: exact for these
            out += int(q).to_bytes(1, "little", signed=True)
    return bytes(out)


def quantize_q4_0_reference(row: np.ndarray) -> bytes:
    """d = (value of largest |x|) / -8; q = min(15, trunc(x/d + 8.5)); x = d*(q - 8)."""
    out = bytearray()
    for x in _blocks(row, 32):
        amax, mx = F32(0), F32(0)
        for v in x:
            if amax < abs(v):
                amax, mx = F32(abs(v)), v
        d = mx / F32(-8)
        inv = F32(1) / d if d != 0 else F32(0)
        q = [min(15, int(v * inv + F32(8.5))) for v in x]
        out += _fp16(d)
        out += bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return bytes(out)


def quantize_q4_1_reference(row: np.ndarray) -> bytes:
    """d = (max - min) / 15, m = min; q = min(15, trunc((x - m)/d + 0.5))."""
    out = bytearray()
    for x in _blocks(row, 32):
        lo, hi = x[0], x[0]
        for v in x:
            lo, hi = min(lo, v), max(hi, v)
        d = (hi - lo) / F32(15)
        inv = F32(1) / d if d != 0 else F32(0)
        q = [min(15, int((v - lo) * inv + F32(0.5))) for v in x]
        out += _fp16(d) + _fp16(lo)
        out += bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return bytes(out)


def _make_qkx2_reference(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """llama.cpp make_qkx2_quants, element by element -> (scale, -min, L)."""
    n = len(x)
    lo, hi = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * x[i]
    if lo > 0:
        lo = F32(0)
    if hi == lo:
        return F32(0), -lo, [0] * n
    iscale = F32(nmax) / (hi - lo)
    scale = F32(1) / iscale
    L = [max(0, min(nmax, _nearest_int(iscale * (v - lo)))) for v in x]
    best = F32(0)
    for i in range(n):
        diff = scale * F32(L[i]) + lo - x[i]
        best = best + w[i] * (F32(abs(diff)) if use_mad else diff * diff)
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (hi - lo)
        la = [max(0, min(nmax, _nearest_int(iscale * (v - lo)))) for v in x]
        sum_l = sum_l2 = sum_xl = F32(0)
        for i in range(n):
            lf = F32(la[i])
            sum_l = sum_l + w[i] * lf
            sum_l2 = sum_l2 + w[i] * lf * lf
            sum_xl = sum_xl + w[i] * lf * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0)
                this_scale = sum_xl / sum_l2
            cur = F32(0)
            for i in range(n):
                diff = this_scale * F32(la[i]) + this_min - x[i]
                cur = cur + w[i] * (F32(abs(diff)) if use_mad else diff * diff)
            if cur < best:
                L, best, scale, lo = la, cur, this_scale, this_min
    return scale, -lo, L


def quantize_q4_k_reference(row: np.ndarray) -> bytes:
    """Super-blocks of 8 x 32: affine sub-blocks, 6-bit scales/mins, fp16 d/dmin."""
    out = bytearray()
    for x in _blocks(row, 256):
        scales, mins, L = [], [], []
        for j in range(8):
            xs = x[32 * j:32 * j + 32]
            sum_x2 = F32(0)
            for v in xs:
                sum_x2 = sum_x2 + v * v
            av_x = F32(np.sqrt(sum_x2 / F32(32)))
            w = [av_x + F32(abs(v)) for v in xs]
            s, m, lj = _make_qkx2_reference(xs, w, 15, -1.0, 0.1, 20, False)
            scales.append(s)
            mins.append(m)
            L += lj
        max_scale, max_min = F32(0), F32(0)
        for s, m in zip(scales, mins, strict=True):
            max_scale, max_min = max(max_scale, s), max(max_min, m)
        inv_s = F32(63) / max_scale if max_scale > 0 else F32(0)
        inv_m = F32(63) / max_min if max_min > 0 else F32(0)
        ls = [min(63, _nearest_int(inv_s * s) & 0xFF) for s in scales]
        lm = [min(63, _nearest_int(inv_m * m) & 0xFF) for m in mins]
        packed = [0] * 12
        for j in range(8):
            if j < 4:
                packed[j] = ls[j]
                packed[j + 4] = lm[j]
            else:
                packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
                packed[j - 4] |= (ls[j] >> 4) << 6
                packed[j] |= (lm[j] >> 4) << 6
        d_all = _fp16_value(max_scale / F32(63))
        m_all = _fp16_value(max_min / F32(63))
        for j in range(8):
            d = d_all * F32(ls[j])
            if d == 0:
                continue
            dm = m_all * F32(lm[j])
            for i in range(32 * j, 32 * j + 32):
                L[i] = max(0, min(15, _nearest_int((x[i] + dm) / d)))
        out += _fp16(max_scale / F32(63)) + _fp16(max_min / F32(63)) + bytes(packed)
        for c in range(4):
            out += bytes(L[64 * c + i] | (L[64 * c + 32 + i] << 4) for i in range(32))
    return bytes(out)


REFERENCE_QUANTIZERS = {
    "q8_0": quantize_q8_0_reference,
    "q4_0": quantize_q4_0_reference,
    "q4_1": quantize_q4_1_reference,
    "q4_k": quantize_q4_k_reference,
}
