"""Half-Quadratic Quantization (Badri & Shaji, 2023): calibration-free weight quantization
that fits each group's zero point (and scale) to the weights themselves.

For a group ``w`` (``gs`` weights), codes ``u = clamp(round(w/s + z), 0, 2^b − 1)`` and
``W_hat = s·(u − z)``. HQQ minimises the sparsity-promoting lp error (p < 1)

    φ(z) = Σ |w − s·(u(z) − z)|^p

by half-quadratic splitting: an auxiliary error ``e ≈ w − W_hat`` and alternating

    e ← shrink_p(w − W_hat, β)          generalised soft-thresholding (lp proximal step)
    z ← mean(u − (w − e)/s)             closed form: argmin_z ||w − e − s(u − z)||²
    β ← κ·β

so large errors (the few weights a shifted range clips) are absorbed by ``e`` and stop
pulling the zero point, while the bulk of the group is fit in least squares. ``s`` starts
from min/max (``formats.integer.choose_qparams``); iterations stop when φ stops
improving and each group keeps the best point seen.

Units: errors are measured in steps of the group's min/max scale s0 (φ and the shrinkage
see (w − W_hat)/s0), so β means the same for a model whose weights are 0.02 or 0.2 wide:
an error counts as a sparse outlier above β^(−1/(2−p)) steps (≈15 at the default β = 0.03,
p = 0.7). The paper's β = 10 acts on raw weights: on 7B-class weights (scale ≈ 0.01) that
is a threshold of ≈ 0.17 ≈ 10–20 steps, but on SmolLM2-135M's 10x wider weights it is ≈ 1
step, which clips real outliers; ``hqq_groups(..., code_units=False)`` keeps the paper's
raw units.

Storage constraint: ``QuantLinear`` holds zero points as uint8 code units, and HQQ's zero is
fractional. So a second phase fixes an integer zero point — phase 1's, rounded, and RTN's
— and runs the same half-quadratic loop on the **scale** (``s ← <w − e, u − z>/<u − z,
u − z>``, stored as fp16 each step, so what is evaluated is what is stored): the scale
absorbs part of what the rounded zero lost. Each group keeps, among RTN's own (scale,
zero) and every phase-2 iterate, the one with the smallest φ — so φ is never worse than
RTN's, group by group. (A fractional zero, fake quantized, can lower the weight error yet
hurt perplexity: a grid without an exact 0 gives every near-zero weight of a group the same
offset, an error that adds up over the group's inputs instead of averaging out; the integer
zero keeps 0 on the grid.)
Symmetric configs (zero fixed at 2^(b−1), and the
per-channel int8 of ``bits=8``) run only the scale phase.

Shapes: ``W [N, K]`` → groups ``[N·K/gs, gs]`` (contiguous input columns, the kernels'
layout), processed ``chunk_groups`` at a time; scale ``[N, G]`` fp16, zero ``[N, G]`` uint8.

Example:
    >>> import torch
    >>> from lessmem.weights.hqq import hqq_quantize, lp_error
    >>> from lessmem.weights.rtn import rtn_quantize
    >>> w = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02  # heavy tails
    >>> q = hqq_quantize(w, bits=3, group_size=64)
    >>> r = rtn_quantize(w, bits=3, group_size=64, symmetric=False)
    >>> q.codes.shape, q.scale.dtype, q.zero.dtype
    (torch.Size([64, 256]), torch.float16, torch.uint8)
    >>> bool(lp_error(w, q.dequantize()) < lp_error(w, r.dequantize()))
    True
"""

from __future__ import annotations

import torch

from ..formats.integer import choose_qparams
from .rtn import QuantizedWeight, check_group_size, check_weight

_CHUNK_GROUPS = 1 << 16  # groups per vectorised chunk (64K x 64 weights = 16 MiB fp32 per temp)
_TOL = 1e-4  # relative improvement of a group's lp error below which it stops
_FP16_TINY = 2.0**-24


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalised soft-thresholding, the proximal step of (1/β)·|x|^p:
    sign(x)·max(|x| − |x|^(p−1)/β, 0); p = 1 is plain soft-thresholding (threshold 1/β).

    Example:
        >>> shrink_lp(torch.tensor([-2.0, 0.05, 0.0, 3.0]), beta=10.0, p=1.0)
        tensor([-1.9000,  0.0000,  0.0000,  2.9000])
    """
    a = x.abs()
    if p == 1:
        return torch.sign(x) * torch.relu(a - 1.0 / beta)
    thr = a.clamp(min=1e-30).pow(p - 1) / beta  # |x|^(p−1) → ∞ as x → 0: small errors vanish
    return torch.sign(x) * torch.relu(a - thr)


def lp_error(w: torch.Tensor, w_hat: torch.Tensor, p: float = 0.7, dim=None) -> torch.Tensor:
    """Σ |w − w_hat|^p (over ``dim``, or all elements): the objective HQQ minimises."""
    d = (w.float() - w_hat.float()).abs().pow(p)
    return d.sum() if dim is None else d.sum(dim=dim)


def _to_fp16(s: torch.Tensor) -> torch.Tensor:
    """A positive scale rounded to fp16 and back (what will be stored)."""
    return s.clamp(min=_FP16_TINY, max=65504.0).to(torch.float16).float()


def _evaluate(w, s, z, lo: float, hi: float, p: float, unit):
    """At (s, z) [R, 1]: signed codes d = u − z, error in steps of ``unit`` rc = (w − s·d)/unit,
    |rc|, |rc|^p [R, gs] and φ = Σ|rc|^p [R]."""
    d = torch.round(w / s + z).clamp(lo, hi) - z
    r = (w - s * d) / unit
    a = r.abs()
    ap = a.pow(p)
    return d, r, a, ap, ap.sum(dim=1)


def _quadratic_part(r, a, ap, beta: float):
    """r − shrink_lp(r, β) = sign(r)·min(|r|, |r|^(p−1)/β): the error left to the closed-form
    step once the shrinkage has taken the large errors (|r|^(p−1) computed as |r|^p / |r|)."""
    t = ap / (a.clamp(min=1e-30) * beta)
    return torch.where(a > t, torch.sign(r) * t, r)


def _step_zero(s, z, d, q, unit):
    """z ← argmin_z ||w − e − s(u − z)||² = z − mean(r − e)/s (scale fixed; q = (r − e)/unit)."""
    return s, z - q.mean(dim=1, keepdim=True) * unit / s


def _step_scale(s, z, d, q, unit):
    """s ← argmin_s ||w − e − s·d||² = s + <r − e, d>/<d, d>, stored as fp16 (zero fixed)."""
    den = (d * d).sum(dim=1, keepdim=True)
    fit = s + (q * d).sum(dim=1, keepdim=True) * unit / den.clamp(min=1)
    return torch.where((den > 0) & (fit > 0), _to_fp16(fit), s), z


def _iterate(w, s, z, lo, hi, p, step, iters, beta, kappa, unit):
    """Up to ``iters`` half-quadratic steps from (s, z) [R, 1]. Each group keeps its best point
    by φ and drops out once a step fails to lower its φ by a relative ``_TOL`` (the rows still
    iterating are gathered, so late iterations cost only what is left). Returns s, z, φ."""
    d, r, a, ap, phi = _evaluate(w, s, z, lo, hi, p, unit)
    best_s, best_z, best = s.clone(), z.clone(), phi.clone()
    idx = torch.arange(w.shape[0], device=w.device)  # rows still iterating
    for _ in range(iters):
        s, z = step(s, z, d, _quadratic_part(r, a, ap, beta), unit)
        beta *= kappa
        d, r, a, ap, cur = _evaluate(w, s, z, lo, hi, p, unit)
        prev = best[idx]
        better = cur < prev
        best_s[idx[better]], best_z[idx[better]], best[idx[better]] = s[better], z[better], cur[better]
        keep = cur < prev * (1 - _TOL)  # the error stopped improving: this group is done
        if not keep.any():
            break
        if not keep.all():
            idx, w, s, z, d, r, a, ap, unit = (t[keep] for t in (idx, w, s, z, d, r, a, ap, unit))
    return best_s, best_z, best


def hqq_groups(wg: torch.Tensor, bits: int, symmetric: bool = False, iters: int = 20,
               lp_norm: float = 0.7, beta: float = 0.03, kappa: float = 1.01,
               code_units: bool = True):
    """HQQ on grouped rows wg [R, gs]: (scale [R] fp16, zero [R] uint8) in code units."""
    w = wg.detach().float()
    lo, hi = (1.0 if symmetric else 0.0), float(2**bits - 1)  # symmetric: ±(2^(b−1) − 1) codes
    s16, zp = choose_qparams(w, bits, symmetric, 1.0, torch.float16)  # RTN's point
    s0 = s16.float()[:, None]
    z_rtn = torch.full_like(s0, 2.0 ** (bits - 1)) if zp is None else zp.float()[:, None]
    if iters == 0:
        return s16, z_rtn[:, 0].to(torch.uint8)
    unit = s0 if code_units else torch.ones_like(s0)
    best_s, best_z, best = s0, z_rtn, None
    starts = [z_rtn]
    if not symmetric:  # phase 1 from min/max's fractional zero, then round it
        z_mm = -w.amin(dim=1, keepdim=True).clamp(max=0) / s0
        _, zf, _ = _iterate(w, s0, z_mm, lo, hi, lp_norm, _step_zero, iters, beta, kappa, unit)
        starts.append(torch.round(zf).clamp(lo, hi))
    for z in starts:  # phase 2 around each integer zero (each start point counts too)
        s, z, cand = _iterate(w, s0, z, lo, hi, lp_norm, _step_scale, iters, beta, kappa, unit)
        better = cand < best if best is not None else torch.ones_like(cand, dtype=torch.bool)
        best_s = torch.where(better[:, None], s, best_s)
        best_z = torch.where(better[:, None], z, best_z)
        best = cand if best is None else torch.minimum(cand, best)
    return best_s[:, 0].to(torch.float16), best_z[:, 0].to(torch.uint8)


def hqq_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool = False,
                 iters: int = 20, lp_norm: float = 0.7, beta: float = 0.03, kappa: float = 1.01,
                 chunk_groups: int = _CHUNK_GROUPS) -> QuantizedWeight:
    """HQQ codes for W [N, K] in groups of ``group_size`` input columns (None: one per row),
    in the ``QuantizedWeight`` layout RTN produces (``QuantLinear.from_quantized`` holds it)."""
    n, k = check_weight(w, bits)
    gs = check_group_size(group_size, k)
    wg = w.detach().float().reshape(-1, gs)  # [N*G, gs], groups contiguous in k
    scales, zeros, codes = [], [], []
    for i in range(0, wg.shape[0], chunk_groups):
        part = wg[i:i + chunk_groups]
        s, z = hqq_groups(part, bits, symmetric, iters, lp_norm, beta, kappa)
        u = torch.round(part / s.float()[:, None] + z.float()[:, None])
        codes.append(u.clamp(1 if symmetric else 0, 2**bits - 1).to(torch.uint8))
        scales.append(s)
        zeros.append(z)
    g = k // gs
    return QuantizedWeight(torch.cat(codes).view(n, k), torch.cat(scales).view(n, g),
                           torch.cat(zeros).view(n, g), bits, gs, symmetric)
