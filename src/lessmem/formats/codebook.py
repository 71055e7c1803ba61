"""Non-uniform Lloyd-Max codebooks: 2^b levels placed where the values are dense.

Each group of E elements shares one scale s; an element is stored as the index of the
nearest codebook level, and x_hat = s · c[idx]. The codebook ``c`` (sorted, 2^b floats)
is either

- ``fit="gaussian"``: the Lloyd-Max quantizer of a standard normal (Max 1960), solved
  once per bit width by Lloyd iteration on the density itself (no sampling, so it is
  deterministic): boundaries t_i = (c_i + c_{i+1}) / 2 and centroids
  c_i = E[X | t_{i-1} < X < t_i] = (φ(t_{i-1}) - φ(t_i)) / (Φ(t_i) - Φ(t_{i-1})).
  For 2 bits this gives ±0.4528, ±1.5104 (MSE 0.1175 σ²).
- ``fit="data"``: the same iteration on the empirical distribution of the normalized
  values (1-D k-means, started from the Gaussian solution; on at most 2^20 of them,
  taken at an even stride, so large tensors fit in bounded time and stay deterministic).

Group normalization ``norm``: ``"rms"`` sets s = sqrt(mean(x²)) (the Gaussian codebook is
designed for unit variance); ``"absmax"`` sets s = max|x| / c_max, so the largest element
lands exactly on the outermost level (the NF4 choice). Neither wins everywhere: SNR on
N(0,1) data, Gaussian levels (dB, 1024×1024, see ``benchmarks/bench_formats.py``):

    bits, group     absmax   rms     best
    2, 32            7.2     9.5     9.5
    3, 32           15.0    14.9    15.3
    4, 32           21.6    20.5    21.7
    4, 1024         19.4    20.2    20.2

so the default ``"best"`` computes both scales and keeps, per group, the one with the
smaller squared error (it costs one extra assignment pass; dequantization is unchanged).

Indices are bit-packed with :func:`~lessmem.formats.packing.pack_bits`; the codebook
(fp32) and the scales are counted in ``nbytes``.

Example:
    >>> import torch
    >>> from lessmem.formats import quantize, PerGroup
    >>> qt = quantize(torch.randn(64, 256), "lm4", granularity=PerGroup(64))
    >>> round(qt.bits_per_element, 3)      # 4 + 16/64 (fp16 scales) + 16·32/16384 (codebook)
    4.281
"""

from __future__ import annotations

import functools
import math

import torch

from ._checks import check_bits, check_float_tensor, check_scale_dtype
from .granularity import Granularity, PerGroup, SuperBlock
from .integer import _store
from .packing import pack_bits, unpack_bits
from .qtensor import DEQUANTIZERS, QFormat, QTensor

CODEBOOK_BITS = (1, 2, 3, 4, 5, 6)  # 7-8 bits: Lloyd on the density takes ~20 s
NORMS = ("best", "absmax", "rms")
FITS = ("gaussian", "data")
FIT_SAMPLES = 1 << 20  # fit="data" runs Lloyd on at most ~this many values (an even stride)


@functools.lru_cache(maxsize=None)
def _gaussian_levels(bits: int) -> tuple[float, ...]:
    n = 2**bits
    # seed: the high-rate optimum (level density ∝ φ^(1/3), i.e. quantiles of N(0, 3))
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    c = math.sqrt(3.0) * torch.special.ndtri(p)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(100000):
        t = torch.cat([-inf, (c[1:] + c[:-1]) / 2, inf])  # cell edges
        pdf = torch.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)  # φ(±inf) = 0
        mass = torch.special.ndtr(t[1:]) - torch.special.ndtr(t[:-1])  # Φ(t_i) - Φ(t_{i-1})
        new = torch.where(mass > 0, (pdf[:-1] - pdf[1:]) / mass, c)
        delta = float((new - c).abs().max())
        c = new
        if delta < 1e-13:
            break
    c = (c - c.flip(0)) / 2  # exact symmetry
    return tuple(c.tolist())


def gaussian_codebook(bits: int) -> torch.Tensor:
    """Lloyd-Max levels for N(0, 1), sorted, float32 [2^bits] (cached per ``bits``).

    Example:
        >>> from lessmem.formats.codebook import gaussian_codebook
        >>> [round(v, 4) for v in gaussian_codebook(2).tolist()]
        [-1.5104, -0.4528, 0.4528, 1.5104]
    """
    check_bits(bits, CODEBOOK_BITS)
    return torch.tensor(_gaussian_levels(bits), dtype=torch.float32)


def midpoints_below(codebook: torch.Tensor) -> torch.Tensor:
    """Decision boundaries as float32, each the largest float32 ≤ the exact midpoint.

    With fp32 inputs x, ``x > m32[i]`` ⇔ ``x > (c_i + c_{i+1}) / 2`` exactly, so
    ``bucketize(x, m32)`` is the exact nearest level with ties going to the lower one.
    """
    c = codebook.double()
    m = (c[1:] + c[:-1]) / 2  # exact in float64 for float32 levels
    m32 = m.float()
    over = m32.double() > m
    return torch.where(over, torch.nextafter(m32, torch.full_like(m32, -math.inf)), m32)


def assign(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for each float32 value (ties -> lower index), uint8.

    idx = #{i : x > m_i} over the 2^b - 1 decision boundaries. Up to 32 levels, one
    vectorized compare-and-add per boundary beats ``torch.bucketize``'s binary search on
    CPU (measured 2-5x); above, bucketize. Both count exactly the same comparisons.
    """
    x = xn.float()
    m = midpoints_below(codebook)
    if m.numel() > 31:
        return torch.bucketize(x.contiguous(), m).to(torch.uint8)
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for v in m.tolist():
        idx += x > v
    return idx


def fit_codebook(values: torch.Tensor, bits: int, max_iter: int = 30,
                 init: torch.Tensor | None = None, tol: float = 1e-6) -> torch.Tensor:
    """1-D Lloyd (k-means) on ``values``, started from ``init`` (Gaussian levels by default).

    Each step assigns every value to its nearest level and moves each level to the mean
    of its values (empty levels stay put); stops after ``max_iter`` steps or when no level
    moves by more than ``tol``. float32 [2^bits].

    Example:
        >>> import torch
        >>> from lessmem.formats.codebook import fit_codebook
        >>> fit_codebook(torch.tensor([-1.0, -1.0, 2.0, 2.0, 2.0]), 1).tolist()
        [-1.0, 2.0]
    """
    check_bits(bits, CODEBOOK_BITS)
    v = values.reshape(-1).float()
    c = (gaussian_codebook(bits) if init is None else init.float()).clone()
    n = c.numel()
    v64 = v.double()
    for _ in range(max_iter):
        idx = assign(v, c).long()
        sums = torch.bincount(idx, weights=v64, minlength=n)
        counts = torch.bincount(idx, minlength=n).double()
        new = torch.where(counts > 0, sums / counts.clamp(min=1), c.double()).float()
        new, _ = torch.sort(new)
        moved = float((new - c).abs().max())
        c = new
        if moved <= tol:
            break
    return c


def _candidate_scales(xf: torch.Tensor, codebook: torch.Tensor, norm: str,
                      scale_dtype: torch.dtype) -> list[torch.Tensor]:
    cands = []
    if norm in ("rms", "best"):
        cands.append(_store((xf * xf).mean(dim=1).sqrt(), scale_dtype))  # RMS
    if norm in ("absmax", "best"):
        cands.append(_store(xf.abs().amax(dim=1) / codebook.abs().max(), scale_dtype))
    return cands


def group_scales(xg: torch.Tensor, codebook: torch.Tensor, norm: str,
                 scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored per-group scale [G] for a grouped view [G, E], and the indices [G, E] under it.

    ``"best"`` keeps, per group, whichever of the RMS and absmax scales gives the smaller
    squared error Σ(x - s·c[idx])² (ties -> RMS).
    """
    xf = xg.float()
    best = best_idx = best_err = None
    for s in _candidate_scales(xf, codebook, norm, scale_dtype):
        sf = s.float().unsqueeze(1)
        idx = assign(xf / sf, codebook)  # [G, E]
        if best is None:
            best, best_idx = s, idx
            if norm != "best":
                break
            best_err = (xf - codebook[idx.long()] * sf).pow(2).sum(dim=1)  # [G]
            continue
        err = (xf - codebook[idx.long()] * sf).pow(2).sum(dim=1)
        better = err < best_err
        best = torch.where(better, s, best)
        best_idx = torch.where(better.unsqueeze(1), idx, best_idx)
        best_err = torch.where(better, err, best_err)
    return best, best_idx


def quantize_codebook(x: torch.Tensor, bits: int = 4, granularity: Granularity | None = None,
                      fit: str = "gaussian", norm: str = "best",
                      scale_dtype: torch.dtype | str = torch.float16,
                      codebook: torch.Tensor | None = None, max_iter: int = 30) -> QTensor:
    """Quantize ``x`` to ``bits``-bit indices into a Lloyd-Max codebook (see module doc).

    ``codebook`` (sorted floats, 2^bits of them) overrides ``fit``. Default granularity:
    ``PerGroup(64)``.

    Example:
        >>> import torch
        >>> from lessmem.formats.codebook import quantize_codebook
        >>> x = torch.randn(32, 128)
        >>> qt = quantize_codebook(x, 3, fit="data")
        >>> qt.fmt.name, tuple(qt.dequantize().shape)
        ('codebook-lm3-data', (32, 128))
    """
    check_bits(bits, CODEBOOK_BITS)
    check_float_tensor(x)
    scale_dtype = check_scale_dtype(scale_dtype)
    if fit not in FITS:
        raise ValueError(f"fit={fit!r}; allowed: {', '.join(FITS)}")
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r}; allowed: {', '.join(NORMS)}")
    granularity = PerGroup(64) if granularity is None else granularity
    if not isinstance(granularity, Granularity) or isinstance(granularity, SuperBlock):
        raise ValueError(
            f"granularity={granularity!r} is not allowed for codebooks; allowed: PerTensor(), "
            "PerChannel(axis), PerToken(), PerGroup(size)"
        )
    xg, meta = granularity.group(x)  # [G, E]
    variant = f"lm{bits}-{fit}"
    if codebook is not None:
        codebook = _check_codebook(codebook, bits)
        variant = f"lm{bits}-custom"
    else:
        codebook = gaussian_codebook(bits)
    scale, idx = group_scales(xg, codebook, norm, scale_dtype)  # [G], [G, E]
    zero = xg.abs().amax(dim=1) == 0  # all-zero groups: s = 0 reconstructs them exactly
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    if variant.endswith("data"):  # re-fit the levels to the normalized values, re-assign
        xn = xg.float() / torch.where(zero, 1.0, scale.float()).unsqueeze(1)  # [G, E]
        flat = xn.reshape(-1)
        step = max(1, flat.numel() // FIT_SAMPLES)  # even stride: deterministic, 2^20 values max
        codebook = fit_codebook(flat[::step], bits, max_iter=max_iter, init=codebook)
        idx = assign(xn, codebook)
    fmt = QFormat("codebook", bits, granularity, True, variant)
    extra = {"codebook": codebook.float().contiguous()}
    return QTensor(pack_bits(idx, bits), scale, None, fmt, tuple(x.shape), x.dtype, meta, extra)


def _check_codebook(codebook, bits: int) -> torch.Tensor:
    if not isinstance(codebook, torch.Tensor) or codebook.ndim != 1 or codebook.numel() != 2**bits:
        raise ValueError(f"codebook must be a 1-D tensor of 2**{bits} = {2**bits} levels, "
                         f"got {getattr(codebook, 'shape', type(codebook).__name__)}")
    c = codebook.float()
    if not torch.isfinite(c).all() or not bool((c[1:] > c[:-1]).all()):
        raise ValueError("codebook levels must be finite and strictly increasing")
    return c


def codebook_indices(qt: QTensor) -> torch.Tensor:
    """Indices in the grouped layout [G, E] (uint8)."""
    g = qt.scale.numel()
    return unpack_bits(qt.codes, qt.fmt.bits, qt.numel).view(g, -1)


def _dequantize_codebook(qt: QTensor) -> torch.Tensor:
    levels = qt.extra["codebook"].float()
    y = levels[codebook_indices(qt).long()] * qt.scale.float().unsqueeze(1)  # [G, E]
    return Granularity.ungroup(y, qt.meta)


DEQUANTIZERS["codebook"] = _dequantize_codebook
