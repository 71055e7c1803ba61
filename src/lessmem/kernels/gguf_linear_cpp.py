"""Fused GGUF dequant-matmul on CPU in C++: ``y = x · W_hatᵀ`` with W held as raw GGUF blocks.

The weight ``W [N, K]`` stays in the bytes a ``.gguf`` file stores (uint8
``[N, K / block_size * type_size]``), for all ten block types of ``formats.gguf``
(Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K) and IQ4_NL / IQ4_XS
(``KERNEL_TYPES``; the codes are table levels, ``w = scale · level``). Per output row ``n`` (rows handed
out in chunks of 16 to ``torch.get_num_threads()`` threads) and per chunk of up to 8 input
rows:

    for each block b of row n:
        q[0:QK], a[g], c[g] = decode(block)          byte ops only: codes, and per group g
                                                     of 16 the factors of w = a·q (+ c)
        for each group g of 16:  w16 = expand(q, a, c, g)     (16 floats, one register)
            for each input row m:  acc[m] += x[m, b·QK + 16g : +16] · w16     (FMA)
    y[m, n] = Σ lanes acc[m] (+ bias[n])

so the float matrix is never materialised, not even one row of it. The expansion does the
float32 operations of ``formats.gguf.dequantize_gguf`` in the same order (``d·(q − 8)``,
``d·q + m``, ``(d·sc)·q − (dmin·m)`` …, built with ``-ffp-contract=off`` so no multiply-add
is fused), hence bit-identical weights; ``gguf_dequantize`` writes them out (used above
``FUSED_MAX_ROWS`` rows: decode once, BLAS). The dot products use fused multiply-adds in
a different order than the reference, so ``y`` equals the float64 reference to float32
rounding (relative error ~1e-7), not bit for bit. Activations stay float32 here;
``gguf_linear_q8`` (below) is the int8-activation path, as llama.cpp multiplies. AVX-512
and AVX2 use intrinsics, other CPUs a plain loop of 16.

Layers under 64k weights × rows run on one thread; larger ones split their rows over
torch's intra-op threads (``at::parallel_for``, the OpenMP pool torch's own ops use: its
threads are still spinning between the back-to-back calls of a decode step, where a
second pool's helpers would compete with them for the cores). Measure speed-ups on a quiet machine
(``benchmarks/bench_gguf_linear.py`` records the load average).

When no compiler is available, or the tensors are not on the CPU, the functions run the
torch fallback in ``gguf_linear_torch`` (the blocks decoded with torch ops on their own
device, bit-identical weights, float32 sums). The test oracle both are checked against is
``gguf_linear_reference`` (numpy decoders, float64 matmul).

Example:
    >>> import torch
    >>> from lessmem.formats.gguf import quantize_gguf, dequantize_gguf
    >>> from lessmem.kernels.gguf_linear_cpp import gguf_linear
    >>> w = torch.randn(8, 256)
    >>> raw = torch.from_numpy(quantize_gguf(w, "q4_k"))
    >>> x = torch.randn(1, 256)
    >>> ref = x.double() @ dequantize_gguf(raw, "q4_k", (8, 256)).double().T
    >>> bool(torch.allclose(gguf_linear(x, raw, "q4_k", 8).double(), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from ..formats.gguf import GGUF_TYPES, gguf_type
from . import gguf_linear_torch as fallback
from ._build import load_cpp_file

# The C++ source: csrc/gguf_linear.cpp (shipped as package data).
_SOURCE_FILE = "gguf_linear.cpp"

# The block types the fused kernels (C++ and the torch fallback) multiply: the ten of
# ``GGUF_TYPES`` and the non-linear 4-bit IQ4_NL / IQ4_XS (``formats.gguf_iquants``).
KERNEL_TYPES = (*GGUF_TYPES, "iq4_nl", "iq4_xs")

_FUNCS = ["gguf_linear", "gguf_linear_q8", "gguf_dequantize", "gguf_dequantize_bf16", "register_ops",
          "gguf_linear_multi", "rms_norm_rows", "rms_sum_width", "rope_rows", "qkv_rope_rows", "silu_mul_rows"]
_FLAGS = ["-ffp-contract=off"]  # decoders must not fuse d*q + m into one rounding


def _mod():
    """The compiled module (None without a compiler); registers the CPU kernels of
    ``torch.ops.lessmem.gguf_linear`` / ``gguf_dequantize`` (``linear_ops``) when first loaded."""
    m = load_cpp_file("lessmem_gguf_linear", _SOURCE_FILE, _FUNCS, _FLAGS)
    if m is not None and m not in _REGISTERED:
        m.register_ops()
        _REGISTERED.append(m)
    return m


_REGISTERED: list = []  # the module whose CPU kernels are registered (one per process)


def available() -> bool:
    """True when the C++ kernel compiled (else the torch fallback of ``gguf_linear_torch`` runs)."""
    return _mod() is not None


def check_shape(qtype, out_features: int, in_features: int):
    """Validate a ``[N, K]`` weight shape for ``qtype`` (K whole blocks); returns the GGUFType."""
    t = gguf_type(qtype)  # ValueError naming the allowed types
    if t.name not in KERNEL_TYPES:  # a type formats can encode but no kernel multiplies
        raise ValueError(f"GGUF type {t.name.upper()} has no dequant-matmul kernel; allowed for a layer: "
                         f"{', '.join(n.upper() for n in KERNEL_TYPES)}")
    n, k = out_features, in_features
    if k != int(k) or k <= 0 or k % t.block_size:
        raise ValueError(f"in_features={k} must be a positive multiple of the {t.name.upper()} "
                         f"block size {t.block_size}")
    if n != int(n) or n <= 0:
        raise ValueError(f"out_features={n} must be positive")
    return t


def _check(raw: torch.Tensor, qtype, out_features: int, in_features: int):
    """Validate the raw block tensor against [N, K] in ``qtype``; returns the GGUFType."""
    t = check_shape(qtype, out_features, in_features)
    n, k = int(out_features), int(in_features)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF blocks must be a uint8 torch.Tensor, got "
                         f"{getattr(raw, 'dtype', type(raw).__name__)}")
    want = n * (k // t.block_size) * t.type_size
    if raw.numel() != want:
        raise ValueError(f"raw holds {raw.numel()} bytes but [{n}, {k}] in {t.name.upper()} needs "
                         f"{want} ({k // t.block_size} blocks of {t.type_size} bytes per row)")
    return t


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W_hat.T (+ bias)`` in x's dtype (float32 sums), ``W`` as raw GGUF rows ``[N, row_bytes]``."""
    t = _check(raw, qtype, out_features, x.shape[-1])
    if bias is not None and bias.numel() != int(out_features):
        raise ValueError(f"bias has {bias.numel()} values; out_features={out_features}")
    return gguf_linear_prechecked(x, raw, t, int(out_features), bias)


_NO_BIAS = torch.empty(0)


def gguf_linear_prechecked(x: torch.Tensor, raw: torch.Tensor, t, out_features: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gguf_linear`` without the argument checks, for callers that validated ``raw`` against
    ``[out_features, x.shape[-1]]`` once (``GGUFLinear``): ``t`` is a ``GGUFType``. Shapes,
    dtype and bias are handled in C++, so the per-call Python overhead, paid by every linear
    of every decoded token, stays small."""
    m = _mod()
    if m is None or not (x.is_cpu and raw.is_cpu):  # the C++ kernel reads CPU memory only
        return fallback.gguf_linear_torch(x, raw, t, out_features, bias)
    return m.gguf_linear(x, raw, t.ggml_id, out_features, _NO_BIAS if bias is None else bias.float())


Q8_TYPES = ("q4_0", "q4_1", "q8_0")  # the weight types gguf_linear_q8 takes


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``gguf_linear_q8`` sees it: each block of 32 along the last dimension rounded
    to ``dx · rint(x / dx)`` with ``dx = amax / 127`` (llama.cpp's q8_1 activations), float32."""
    xf = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xf.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xf * inv) * d).reshape(x.shape)


def gguf_linear_q8(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gguf_linear`` with int8 activations, as llama.cpp computes a quantized matmul: x is
    quantized per block of 32 (``quantize_activations_q8``) and each block's dot product with
    the weight codes is an integer sum (AVX-512 VNNI / AVX2), scaled once per block. Q4_0,
    Q4_1 and Q8_0 weights (``Q8_TYPES``); equals ``gguf_linear(quantize_activations_q8(x), …)``
    to float32 rounding. Each row's result is independent of the rows batched with it."""
    t = _check(raw, qtype, out_features, x.shape[-1])
    if t.name not in Q8_TYPES:
        raise ValueError(f"gguf_linear_q8 takes {', '.join(Q8_TYPES)} weights, got {t.name}")
    if bias is not None and bias.numel() != int(out_features):
        raise ValueError(f"bias has {bias.numel()} values; out_features={out_features}")
    return gguf_linear_q8_prechecked(x, raw, t, int(out_features), bias)


def gguf_linear_q8_prechecked(x: torch.Tensor, raw: torch.Tensor, t, out_features: int,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gguf_linear_q8`` without the argument checks (``GGUFLinear`` checked them once)."""
    m = _mod()
    if m is None or not (x.is_cpu and raw.is_cpu):
        y = fallback.gguf_linear_torch(quantize_activations_q8(x), raw, t, out_features, bias)
        return y.to(x.dtype)
    return m.gguf_linear_q8(x, raw, t.ggml_id, out_features, _NO_BIAS if bias is None else bias.float())


def gguf_dequantize(raw: torch.Tensor, qtype, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W_hat [N, K]``, bit-identical to ``formats.gguf.dequantize_gguf`` (float32), or to its
    ``.to(torch.bfloat16)`` with ``dtype=torch.bfloat16`` (on the CPU written as bfloat16 in
    the same pass: no float32 matrix)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"gguf_dequantize dtype={dtype}; allowed: torch.float32, torch.bfloat16")
    t = _check(raw, qtype, out_features, in_features)
    m = _mod()
    if m is None or not raw.is_cpu:  # decoded with torch ops on raw's own device
        return fallback.gguf_dequantize_torch(raw, t, out_features).to(dtype)
    if dtype is torch.bfloat16:
        return m.gguf_dequantize_bf16(raw, t.ggml_id, int(out_features), int(in_features))
    return m.gguf_dequantize(raw, t.ggml_id, int(out_features), int(in_features))
