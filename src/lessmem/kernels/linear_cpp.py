"""Fused CPU dequant-matmul kernels in C++ (built once by ``_build.load_cpp``).

Three kernels; weights are expanded in registers, never written back as a float matrix;
scales are read as stored (fp16), zero points as uint8:

- ``int8_linear``   y[m, n] = s[n] · Σ_k x[m, k] · w[n, k]                  (w int8)
- ``w8a8_linear``   y[m, n] = sx[m] · s[n] · Σ_k xq[m, k] · w[n, k]         (int32 sums)
- ``lowbit_linear`` y[m, n] = Σ_g s[n, g] · Σ_{k∈g} x̂[m, k] · (u[n, k] − z[n, g])
                    with u the unsigned 2/3/4-bit codes packed by ``formats.packing.pack_bits``
                    row-major (row n starts at byte n·K·bits/8), z the zero point in code units
                    and x̂ the activations in 16-bit fixed point per group (below).

``lowbit_linear`` runs on integer dot products. Activations are rounded per (row, group)
to 16-bit fixed point, ``x̂ = d·q`` with ``d = max|x_g| / 32258`` and ``q = round(x / d)``
(so ``|x − x̂| ≤ d/2``: relative error ≤ 1.55e-5 of the group's largest activation;
``linear_torch.quantize_act16`` is the torch twin), and split ``q = 256·hi + lo`` into two
int8 halves (hi in [−126, 126], lo in [−128, 127]). Codes are decoded 32 at a time into
bytes (2-bit: one 8-byte broadcast, a per-qword shift by 0/2/4/6, a mask; 4-bit: one
16-byte broadcast, shift 0/4; 3-bit: a byte shuffle, then AVX-512 VBMI multishift or,
without it, shifts and masks), and multiplied with the halves by ``dpbusd`` (AVX-512 VNNI)
or ``maddubs`` + ``madd`` (AVX2) into int32:

    y[m, n] = Σ_g s[n, g] · d[m, g] · (256·Σ_{k∈g} u·hi + Σ_{k∈g} u·lo − z[n, g] · Σ_{k∈g} q)

The int8 halves are laid out per 32-code block in the order the decode produces, so the
hot loop has no shuffles; per group, ``256·hi_sum + lo_sum`` is formed in int32 and scaled
once in float. The zero-point term and the factors ``s·d`` are computed per weight row in
8-lane steps over the groups. Up to 4 activation rows share one decode (batch 2..16 runs in
tiles of 4 rows). Layers with fewer than ``PAR_MIN_WORK`` (64k) multiply-adds run on one thread
(an OpenMP region's wake-up costs more than they take). Without AVX2/FMA/F16C (or built with
``-DLESSMEM_NO_SIMD``) the same integer math runs in plain C++; ``-DLESSMEM_NO_VNNI`` /
``-DLESSMEM_NO_VBMI`` select the AVX2 fallbacks (the tests build all three). Group sizes:
multiples of 32, at most 32768.

Decoding reads up to 16 bytes from a block's start, and the group vectors are read in
8-wide steps: where that would pass the end of the codes / scales / zero points, the row is
read from a zero-padded copy.

When no compiler is available, or a tensor is not on the CPU, each function runs its
torch fallback in ``linear_torch`` (same math, any device). The test oracle both are
checked against is ``linear_reference`` (float64, dequantize then matmul).

Example:
    >>> import torch
    >>> from lessmem.kernels.linear_cpp import int8_linear
    >>> w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    >>> s = (torch.rand(16) / 100).half()
    >>> x = torch.randn(1, 64)
    >>> ref = x @ (w.float() * s.float()[:, None]).T
    >>> bool(torch.allclose(int8_linear(x, w, s), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from . import linear_torch as fallback
from ._build import load_cpp_file

# The C++ source: csrc/linear.cpp (shipped as package data).
_SOURCE_FILE = "linear.cpp"

_FUNCS = ["int8_linear", "w8a8_linear", "lowbit_linear", "simd_build", "register_ops"]


def _mod(extra_cflags: tuple[str, ...] = ()):
    """The compiled module (None without a compiler); the default build registers the CPU
    kernels of ``torch.ops.lessmem.*_linear`` (``linear_ops``) when first loaded, a build
    with other flags never does."""
    m = load_cpp_file("lessmem_linear", _SOURCE_FILE, _FUNCS, list(extra_cflags) or None)
    if m is not None and not extra_cflags and m not in _REGISTERED:
        m.register_ops()
        _REGISTERED.append(m)
    return m


_REGISTERED: list = []  # the module whose CPU kernels are registered (one per process)


def available() -> bool:
    """True when the C++ kernels compiled (else the torch fallbacks of ``linear_torch`` run)."""
    return _mod() is not None


def _2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype}; allowed: {dtype}")


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (scale[:, None] · w).T`` with w int8 [N, K], scale fp16 [N] (fp32 out)."""
    _check_dtype("scale", scale, torch.float16)
    m = _mod()
    x2 = _2d(x)
    if m is None or not (x2.is_cpu and w.is_cpu):  # the C++ kernel reads CPU memory only
        y = fallback.int8_linear_torch(x2, w, scale)
    else:
        y = m.int8_linear(x2, w, scale.reshape(-1))
    return y.view(*x.shape[:-1], w.shape[0])


def w8a8_linear(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(sx · xq) @ (scale · w).T`` for int8 xq [M, K], sx [M], w [N, K], fp16 scale [N]."""
    _check_dtype("scale", scale, torch.float16)
    m = _mod()
    if m is None or not (xq.is_cpu and w.is_cpu):
        return fallback.w8a8_linear_torch(xq, sx, w, scale)
    return m.w8a8_linear(xq, sx.float(), w, scale.reshape(-1))


def lowbit_supported(in_features: int, group_size: int) -> bool:
    """Whether ``lowbit_linear`` takes this shape: whole 32-code blocks in every group, and
    groups of at most 32768 (its int32 lane sums cannot overflow below ~35000)."""
    return group_size % 32 == 0 and group_size <= 32768 and in_features % group_size == 0


def lowbit_linear(x: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor,
                  zero: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Group-wise 2/3/4-bit dequant-matmul (see the module doc for the formula), plus bias.

    ``x [..., K]`` any float dtype (rounded per group to 16-bit fixed point as in the module
    doc), ``codes`` from ``pack_bits``, ``scale [N, G]`` fp16, ``zero [N, G]`` uint8, optional
    ``bias [N]``; returns float32 ``[..., N]``.
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"lowbit_linear bits={bits!r}; allowed: 2, 3, 4")
    n, k = scale.shape[0], x.shape[-1]
    if not lowbit_supported(k, group_size):
        raise ValueError(f"in_features={k} and group_size={group_size}: allowed are a group_size "
                         "that is a multiple of 32, at most 32768, and divides in_features")
    _check_dtype("scale", scale, torch.float16)
    _check_dtype("zero", zero, torch.uint8)
    if tuple(scale.shape) != (n, k // group_size) or scale.shape != zero.shape:
        raise ValueError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)}; allowed: both "
                         f"[N, in_features / group_size] = [{n}, {k // group_size}]")
    if codes.dtype != torch.uint8 or codes.numel() < n * k * bits // 8:
        raise ValueError(f"codes {codes.dtype} with {codes.numel()} bytes; allowed: uint8 with "
                         f"N·K·bits/8 = {n * k * bits // 8} bytes")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)}; allowed: None or [{n}]")
    return lowbit_linear_unchecked(x, codes, bits, scale, zero, group_size, bias)


_NO_BIAS = torch.empty(0)


def lowbit_linear_unchecked(x: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor,
                            zero: torch.Tensor, group_size: int,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``lowbit_linear`` without the argument checks, for callers that validated their
    tensors once (``QuantLinear`` at construction): less Python per call at batch 1."""
    m = _mod()
    x2 = _2d(x)
    if m is None or not (x2.is_cpu and codes.is_cpu):
        y = fallback.lowbit_linear_torch(x2, codes, bits, scale, zero, group_size, bias)
    else:
        y = m.lowbit_linear(x2, codes, bits, scale, zero, group_size,
                            _NO_BIAS if bias is None else bias.float())
    return y.view(*x.shape[:-1], scale.shape[0])
