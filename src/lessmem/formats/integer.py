"""Integer affine quantization, 2-8 bits, symmetric or asymmetric, any granularity.

Symmetric (zero point 0):   s = clip * max|x| / qmax,  qmax = 2^(b-1) - 1
                            q = clamp(round(x / s), -qmax, qmax),   x_hat = s * q
Asymmetric (min/max):       s = clip * (max(x,0) - min(x,0)) / (2^b - 1)
                            z = clamp(round(-min(x,0) / s), 0, 2^b - 1)   (integer, uint8)
                            u = clamp(round(x / s) + z, 0, 2^b - 1),  x_hat = s * (u - z)
The range always contains 0, so 0 is exact and |x - x_hat| <= s/2 without clipping.
Scales are rounded to ``scale_dtype`` *before* the codes are chosen, so the bound holds
for the stored scale; asymmetric scales are rounded *up* (a scale rounded down would
stretch max - min past 2^b - 1 steps and clip the top code by up to (2^b - 1)·ulp/2). Rounding is round-half-to-even (``torch.round``).

Codes are stored unsigned and bit-packed: symmetric codes are offset by 2^(b-1).

SuperBlock granularity: each sub-block's scale is stored as a ``sub_scale_bits`` code
against one fp16 scale per super-block, rounded *up* (ceil) so no element clips.

Example (a 4-element key vector to int8, symmetric):
    >>> import torch
    >>> from lessmem.formats import quantize, PerToken
    >>> k = torch.tensor([[1.20, -0.45, 3.80, -2.10]])
    >>> qt = quantize(k, "int8", granularity=PerToken(), scale_dtype=torch.float32)
    >>> qt.int_codes().tolist()
    [[40, -15, 127, -70]]
"""

from __future__ import annotations

import torch

from ._checks import check_bits, check_clip_ratio, check_float_tensor, check_scale_dtype
from .granularity import Granularity, PerTensor, SuperBlock
from .packing import pack_bits, unpack_bits
from .qtensor import CODE_READERS, DEQUANTIZERS, QFormat, QTensor

_TINY = {torch.float16: 6.2e-5, torch.bfloat16: 1e-30, torch.float32: 1e-30}


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Code range: symmetric [-qmax, qmax], asymmetric [0, 2^b - 1]."""
    if symmetric:
        q = 2 ** (bits - 1) - 1
        return -q, q
    return 0, 2**bits - 1


def _store(s: torch.Tensor, scale_dtype: torch.dtype, round_up: bool = False) -> torch.Tensor:
    """Round a positive scale to the storage dtype, keeping it positive and finite.

    ``round_up``: the smallest storable value ≥ s instead of the nearest, so that a range
    divided by the stored scale never exceeds the code range (no silent clipping).
    """
    s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero groups: any scale works
    finfo = torch.finfo(scale_dtype)
    s = s.clamp(min=_TINY[scale_dtype], max=finfo.max)
    out = s.to(scale_dtype)
    if round_up:
        low = (out.float() < s) & (out < finfo.max)
        out = torch.where(low, torch.nextafter(out, torch.full_like(out, finfo.max)), out)
    return out


def _asym_qmax(bits):
    """2^b − 1: an int, or per row a float tensor [G] when ``bits`` is a tensor (a grouped
    view whose rows have their own bits: KV keys with bits per channel)."""
    return 2.0 ** bits.float() - 1 if isinstance(bits, torch.Tensor) else 2**bits - 1


def _clamp_codes(v: torch.Tensor, qmax) -> torch.Tensor:
    """``v`` ([G] or [G, E]) clamped to [0, qmax] (qmax an int, or one per row)."""
    if isinstance(qmax, torch.Tensor):
        return torch.minimum(v.clamp(min=0), qmax.view(-1, *([1] * (v.dim() - 1))))
    return v.clamp(0, qmax)


def choose_qparams(xg: torch.Tensor, bits, symmetric: bool, clip_ratio: float = 1.0,
                   scale_dtype: torch.dtype = torch.float16):
    """Per-row scale (stored dtype) and integer zero point for a grouped view [G, E].
    ``bits``: an int, or (asymmetric only) a tensor [G] of each row's own bits (>= 1)."""
    xf = xg.float()
    if symmetric:
        _, qmax = qrange(bits, True)
        amax = xf.abs().amax(dim=1) * clip_ratio
        return _store(amax / qmax, scale_dtype), None
    lo = xf.amin(dim=1).clamp(max=0) * clip_ratio
    hi = xf.amax(dim=1).clamp(min=0) * clip_ratio
    qmax = _asym_qmax(bits)
    # rounded up: (hi - lo) / s <= qmax, so round(x/s) + z never clips past s/2
    scale = _store((hi - lo) / qmax, scale_dtype, round_up=True)
    zp = _clamp_codes(torch.round(-lo / scale.float()), qmax).to(torch.uint8)
    return scale, zp


def quantize_grouped(xg: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                     bits) -> torch.Tensor:
    """Unsigned codes [G, E] (uint8) for a grouped view, given stored scale/zero point
    (``bits``: as :func:`choose_qparams` takes them)."""
    s = scale.float().unsqueeze(1)
    if zp is None:
        lo, hi = qrange(bits, True)
        q = torch.round(xg.float() / s).clamp(lo, hi)
        return (q + 2 ** (bits - 1)).to(torch.uint8)
    u = _clamp_codes(torch.round(xg.float() / s) + zp.float().unsqueeze(1), _asym_qmax(bits))
    return u.to(torch.uint8)


def dequantize_grouped(u: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                       bits: int) -> torch.Tensor:
    """float32 [G, E] from unsigned codes and stored scale/zero point."""
    off = zp.float().unsqueeze(1) if zp is not None else float(2 ** (bits - 1))
    return (u.float() - off) * scale.float().unsqueeze(1)


def _superblock_scales(scale: torch.Tensor, g: SuperBlock):
    """Quantize per-sub-block scales [G_sub] against one fp16 scale per super-block.

    Returns (sub_codes uint8 [G_sub], super_scale fp16 [G_super], effective scale fp32).
    Sub-scales are rounded up so the effective scale never shrinks (no clipping).
    """
    n = g.subs_per_block
    s = scale.float().view(-1, n)
    smax = 2**g.sub_scale_bits - 1
    d = _store(s.amax(dim=1) / smax, torch.float16, round_up=True)  # s / d <= smax
    sc = torch.ceil(s / d.float().unsqueeze(1) - 1e-6).clamp(1, smax)
    eff = sc * d.float().unsqueeze(1)
    return sc.to(torch.uint8).view(-1), d, eff.view(-1)


def quantize_int(x: torch.Tensor, bits: int = 8, granularity: Granularity | None = None,
                 symmetric: bool = True, clip_ratio: float = 1.0,
                 scale_dtype: torch.dtype | str = torch.float16) -> QTensor:
    """Quantize ``x`` to ``bits``-bit integers with one scale per group (see module doc)."""
    check_bits(bits)
    check_float_tensor(x)
    clip_ratio = check_clip_ratio(clip_ratio)
    scale_dtype = check_scale_dtype(scale_dtype)
    granularity = PerTensor() if granularity is None else granularity
    if not isinstance(granularity, Granularity):
        raise ValueError(
            f"granularity={granularity!r} must be a Granularity object "
            "(PerTensor(), PerChannel(axis), PerToken(), PerGroup(size), SuperBlock(size, sub))"
        )
    xg, meta = granularity.group(x)
    scale, zp = choose_qparams(xg, bits, symmetric, clip_ratio, scale_dtype)
    extra = {}
    if isinstance(granularity, SuperBlock):
        sub_codes, super_scale, eff = _superblock_scales(scale, granularity)
        extra = {"sub_scale_codes": pack_bits(sub_codes, granularity.sub_scale_bits),
                 "super_scale": super_scale}
        if zp is not None:  # re-derive zero points against the effective scale
            lo = xg.float().amin(dim=1).clamp(max=0) * clip_ratio
            zp = torch.round(-lo / eff).clamp(0, 2**bits - 1).to(torch.uint8)
        u = quantize_grouped(xg, eff, zp, bits)
        scale = None
    else:
        u = quantize_grouped(xg, scale, zp, bits)
    if zp is not None and bits < 8:
        zp_stored = pack_bits(zp, bits)
        extra["zero_point_packed"] = zp_stored
        zp_field = None
    else:
        zp_field = zp
    fmt = QFormat("int", bits, granularity, symmetric)
    return QTensor(pack_bits(u, bits), scale, zp_field, fmt, tuple(x.shape), x.dtype, meta, extra)


def _effective_qparams(qt: QTensor):
    g = qt.fmt.granularity
    n_groups = g.n_groups(qt.shape)
    zp = qt.zero_point
    if zp is None and "zero_point_packed" in qt.extra:
        zp = unpack_bits(qt.extra["zero_point_packed"], qt.fmt.bits, n_groups)
    if isinstance(g, SuperBlock):
        sub = unpack_bits(qt.extra["sub_scale_codes"], g.sub_scale_bits, n_groups)
        d = qt.extra["super_scale"].float()
        scale = (sub.float().view(-1, g.subs_per_block) * d.unsqueeze(1)).view(-1)
    else:
        scale = qt.scale
    return scale, zp


def grouped_codes(qt: QTensor) -> torch.Tensor:
    """Unsigned codes in the grouped layout [G, E]."""
    g = qt.fmt.granularity
    n_groups = g.n_groups(qt.shape)
    e = qt.numel // n_groups
    return unpack_bits(qt.codes, qt.fmt.bits, qt.numel).view(n_groups, e)


def int_codes(qt: QTensor) -> torch.Tensor:
    if qt.fmt.kind != "int":
        raise ValueError(f"int_codes() needs an integer QTensor, this one is {qt.fmt.name}")
    u = grouped_codes(qt).to(torch.int16)
    if qt.fmt.symmetric:
        u = u - 2 ** (qt.fmt.bits - 1)
    return Granularity.ungroup(u, qt.meta)


def _dequantize_int(qt: QTensor) -> torch.Tensor:
    scale, zp = _effective_qparams(qt)
    xg = dequantize_grouped(grouped_codes(qt), scale, zp, qt.fmt.bits)
    return Granularity.ungroup(xg, qt.meta)


DEQUANTIZERS["int"] = _dequantize_int
CODE_READERS["int"] = int_codes
