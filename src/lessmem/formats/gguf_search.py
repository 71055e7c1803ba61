"""The scale searches behind GGUF's K-quants (llama.cpp ``ggml-quants.c``), vectorized.

Each works on many small groups at once: rows x [S, n] (a sub-block each), returning a
per-row scale and integer codes, with the same float32 operations in the same order
as the C loops, so the bytes that follow are llama.cpp's:

- ``make_qkx2``: affine x ~ s*L + m (m <= 0, L in [0, nmax]); try ``nstep+1`` trial
  inverse scales (rmin + rdelta*i + nmax) / (max - min), fit (s, m) to each trial's
  codes by weighted least squares, keep the smallest weighted error. (llama.cpp's
  ``make_qkx3_quants``, used with an importance matrix, is the same procedure.)
- ``make_q3``: symmetric x ~ s*L, L in [-nmax, nmax-1], start from the extreme value,
  then coordinate descent: move one code at a time when it raises
  (sum w x L)^2 / (sum w L^2) with w = x^2.
- ``make_qx``: symmetric, weighted least-squares scale for 19 trial inverse scales
  -(nmax + 0.1*i) / max, keep the best (w = x^2 or given weights).
- ``make_qp``: non-negative values (the sub-block scales and mins themselves) onto
  [0, nmax]: best of 9 trial scales, then the same coordinate descent, weighted.

Sums run left to right like C's loops (``_seqsum``), never pairwise.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
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


# The searches take rows [S, n] but work column-major ([n, S], one row per element
# position) so each step of C's element loop is one contiguous vector operation.

def make_qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """Affine search over rows of x [S, n] with weights w -> (scale [S], -min [S], L [S, n]).

    Example (Q4_K's settings):
        >>> x = np.linspace(-1, 2, 32, dtype=np.float32)[None]
        >>> s, neg_min, L = make_qkx2(x, np.ones_like(x), 15, -1.0, 0.1, 20, False)
        >>> float(np.abs(s[:, None] * L - neg_min[:, None] - x).max()) < 0.11
        True
    """
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


def make_qx(x, nmax, w=None):
    """Symmetric weighted search (rmse_type 1) -> (scale [S], L [S, n] in [0, 2*nmax)).

    Weights ``w`` [S, n] (an importance matrix) or, when None, w = x^2.

    Example (Q6_K's settings): x ~ scale * (L - nmax)
        >>> x = np.array([[0.5, -1.0, 0.25, 0.0] * 4], dtype=np.float32)
        >>> s, L = make_qx(x, 32)
        >>> bool((s * (L.astype(np.float32) - 32) == x).all())
        True
    """
    x = np.ascontiguousarray(x.T)
    mx, amax = _first_absmax_cols(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x if w is None else np.ascontiguousarray(w.T)
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
    """Symmetric search with coordinate descent (do_rmse) -> (scale [S], L [S, n] in [0, 2*nmax)).

    Example (Q3_K's settings): x ~ scale * (L - nmax), codes -4..3
        >>> x = np.array([[3.0, -4.0, 1.0, 0.0] * 4], dtype=np.float32)
        >>> s, L = make_q3(x, 4)
        >>> (s * (L.astype(np.float32) - 4)).tolist() == x.tolist()
        True
    """
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


def make_qp(x, nmax, w):
    """Weighted fit of non-negative x [S, n] to s*L, L in [0, nmax] -> (scale [S], L [S, n]).

    L is returned as C stores it (uint8, so a negative code would wrap to 256 + code).

    Example (Q4_K's 6-bit sub-block scales):
        >>> scales = np.array([[0.10, 0.05, 0.20, 0.15, 0.0, 0.07, 0.12, 0.2]], dtype=np.float32)
        >>> d, L = make_qp(scales, 63, np.ones_like(scales))
        >>> int(L.max()) <= 63 and float(np.abs(d[:, None] * L - scales).max()) < 0.002
        True
    """
    x, w = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)
    n = x.shape[0]
    mx = np.maximum(x.max(axis=0), F32(0))
    zero = mx < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / mx
        scale = F32(1) / iscale
        diff = x - scale * (_rint(iscale * x) & 0xFF).astype(F32)
        best = _seqsum((w * diff) * diff)
        for i in range(-4, 5):
            if i == 0:
                continue
            isc = (F32(0.1) * F32(i) + F32(nmax)) / mx
            l_is = np.minimum(nmax, _rint(isc * x)).astype(F32)
            diff = x - (F32(1) / isc) * l_is
            mse = _seqsum((w * diff) * diff)
            take = mse < best
            best = np.where(take, mse, best)
            iscale = np.where(take, isc, iscale)
        li = np.minimum(nmax, _rint(iscale * x))
        sumlx, suml2 = _lsq_sums(x, w, li.astype(F32))
        L = li & 0xFF  # uint8 store
        wx = w * x
        for _ in range(5):  # coordinate descent, as make_q3
            for i in range(n):
                lf = L[i].astype(F32)
                slx = sumlx - wx[i] * lf
                sl2 = suml2 - (w[i] * lf) * lf
                new = np.minimum(nmax, _rint((x[i] * sl2) / slx))
                nf = new.astype(F32)
                slx2 = slx + wx[i] * nf
                sl22 = sl2 + (w[i] * nf) * nf
                ok = (slx > 0) & (sl2 > 0) & (new != L[i])
                ok &= (slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22
                L[i] = np.where(ok, new & 0xFF, L[i])
                sumlx = np.where(ok, slx2, sumlx)
                suml2 = np.where(ok, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, np.ascontiguousarray(np.where(zero, 0, L).T)
