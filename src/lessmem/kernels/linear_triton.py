"""Triton dequant-matmuls for QuantLinear's layouts (the CUDA backends of the linear ops).

Three kernels, the same math as the C++ ones of :mod:`~lessmem.kernels.linear_cpp` (its
module doc), float32 out, weights expanded in registers and never written back:

- ``lowbit_linear`` y[m, n] = Σ_g s[n, g] · Σ_{k∈g} x[m, k] · (u[n, k] − z[n, g]) (+ bias[n])
  with u the unsigned 2/3/4-bit codes packed by ``formats.packing.pack_bits`` row-major (row
  n starts at byte n·K·bits/8), fp16 s, uint8 z. Unlike the C++ kernel the activations are
  used as given (no 16-bit fixed point): fp32 products and sums.
- ``int8_linear``   y[m, n] = s[n] · Σ_k x[m, k] · w[n, k]          (int8 w, fp16 s: W8A16)
- ``w8a8_linear``   y[m, n] = sx[m] · s[n] · Σ_k xq[m, k] · w[n, k]  (int8 xq and w; the sum is
  exact: int32 accumulation, so K ≤ 131072 = 2³¹ / 128²)

Design (a weight-only-quantized GEMV for decode, batch M = 1..16, where reading the codes is
the cost; after the W4A16 GEMV kernels of FasterTransformer / TensorRT-LLM and of
GPTQ-triton, and the dequantize-in-registers idea of Frantar et al., "MARLIN", 2024):

- One program per BLOCK_N output rows × BLOCK_M activation rows (× a split of K, see below).
  It walks K in BLOCK_K steps; each step loads the packed code bytes of its BLOCK_N rows
  (``BLOCK_K·bits/8`` contiguous bytes per row: wide, coalesced loads along K), unpacks them
  with shifts and masks and ``tl.interleave`` (which keeps the codes in the thread that loaded
  their byte: no shuffles), and converts codes to floats with the magic-number trick
  ``bitcast(u | 0x4B000000) − (2²³ + z) = u − z`` (one OR and one FSUB, exact: Kim et al.,
  "Who Says Elephants Can't Run", 2022, as in FasterTransformer and MARLIN).
  3-bit: each 8 codes are 3 bytes (a 24-bit little-endian word), read as 3 byte loads.
- BLOCK_K is the largest power of two dividing the group size (at most 128; 64 for the
  ``tl.dot`` path), so a step never crosses a group: the step's scale and zero point are one
  value per row, the zero point is subtracted per element and the scale multiplies the
  step's [M, N] partial sums once. K is a multiple of the group size, hence of BLOCK_K: no
  K tail. (int8 / w8a8: BLOCK_K 128 or 64, K of any size, the tail masked.)
- M ≤ 4 (decode): broadcast multiply and ``tl.sum`` over K per step ([BLOCK_M, BLOCK_N,
  BLOCK_K] products, BLOCK_M the next power of two ≥ M). M > 4: ``tl.dot`` on BLOCK_M ≥ 16
  tiles, fp32 with ``input_precision="ieee"`` (no TF32: results within float32 summation of
  the float64 oracle), int8·int8 → int32 for w8a8.
- Enough programs for the device: on CUDA, BLOCK_N halves (down to 8, 16 for ``tl.dot``)
  while there are fewer than 2 programs per SM; if there are still fewer than one per SM
  and K has ≥ 4 steps, K is split across programs (split-K). The splits write partials
  ``[S, M, N]`` that one ``sum`` adds in a fixed order (deterministic; w8a8 adds its int32
  partials as int64, so its sums stay exact); without a split the kernel writes y directly.
- x may be float32, float16 or bfloat16 (float64 is cast to float32 first): it is loaded as
  stored and converted to float32 in the kernel (Triton's interpreter has no bfloat16 math,
  only the conversion). Rows of x may be strided; its last dimension must have stride 1 (it
  is copied otherwise). Scales, zero points, bias are read as stored (fp16, uint8, float).

Shapes taken (:func:`lowbit_supported`): group_size a positive multiple of 32 that divides
K. Every function checks its arguments before launching and raises ``ValueError`` naming
the value and what is allowed (dtype, shape, bits, group size, device).

On CUDA tensors the kernels are compiled by Triton. With ``TRITON_INTERPRET=1`` set before
triton is imported they run on CPU tensors under Triton's interpreter:
``tests/kernels/test_triton_linear.py`` checks them against ``linear_reference`` (float64)
that way, in a subprocess, on machines without a GPU.

Example:
    >>> import torch  # doctest: +SKIP
    >>> from lessmem.kernels.linear_triton import lowbit_linear  # doctest: +SKIP
    >>> y = lowbit_linear(x.cuda(), codes.cuda(), 4, scale.cuda(), zero.cuda(), 128)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib

import torch

from ._triton import available, interpreting, tl, triton  # noqa: F401  (available: public)
from ._triton import jit as _jit

LOWBIT_BITS = (2, 3, 4)
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GEMV_MAX_M = 4  # up to this many activation rows: broadcast-and-sum; above: tl.dot
GEMV_BLOCK_K = 128  # codes per row per step (lowbit: at most; the group size may cap it)
DOT_BLOCK_K = 64
GEMV_TILE = 4096  # BLOCK_M·BLOCK_N·BLOCK_K products per step on the GEMV path
MAX_BLOCK_N = 64
W8A8_MAX_K = 2**31 // (128 * 128)  # int32 sums of int8·int8 products cannot overflow below


def lowbit_supported(in_features: int, group_size: int) -> bool:
    """Whether ``lowbit_linear`` takes this shape: group_size a positive multiple of 32 that
    divides in_features (so every step of BLOCK_K codes lies in one group)."""
    return group_size > 0 and group_size % 32 == 0 and in_features > 0 and in_features % group_size == 0


@_jit
def _lowbit_kernel(X, sxm, C, row_bytes, S, Z, G, group_size, BIAS, Y, M, N, tiles_per_split,
                   BITS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    c_rows = C + offs_n.to(tl.int64) * row_bytes  # [BLOCK_N] row starts in the code bytes
    x_rows = X + offs_m.to(tl.int64) * sxm
    sz_rows = offs_n.to(tl.int64) * G
    n_steps = (G * group_size) // BLOCK_K
    t_lo = pid_s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_steps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t in range(t_lo, t_hi):
        k0 = tl.multiple_of(t * BLOCK_K, BLOCK_K)
        g = k0 // group_size  # the step's group (BLOCK_K divides group_size)
        s = tl.load(S + sz_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(Z + sz_rows + g, mask=n_ok, other=0).to(tl.float32)
        # ---- codes u [BLOCK_N, BLOCK_K] from the bit stream (code k at bits [bits·k, bits·k + bits))
        if BITS == 4:  # byte j: codes 2j (low nibble), 2j + 1
            ob = tl.arange(0, BLOCK_K // 2)
            b = tl.load(c_rows[:, None] + (k0 // 2 + ob)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            u = tl.interleave(b & 15, b >> 4)
        elif BITS == 2:  # byte j: codes 4j + i at bits 2i
            ob = tl.arange(0, BLOCK_K // 4)
            b = tl.load(c_rows[:, None] + (k0 // 4 + ob)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            u = tl.interleave(tl.interleave(b & 3, (b >> 4) & 3), tl.interleave((b >> 2) & 3, b >> 6))
        else:  # 3 bits: bytes 3j..3j+2 form a 24-bit word v holding codes 8j + i at bits 3i
            ob = tl.arange(0, BLOCK_K // 8)
            p = c_rows[:, None] + ((k0 // 8 + ob) * 3)[None, :]
            v = tl.load(p, mask=n_ok[:, None], other=0).to(tl.int32)
            v |= tl.load(p + 1, mask=n_ok[:, None], other=0).to(tl.int32) << 8
            v |= tl.load(p + 2, mask=n_ok[:, None], other=0).to(tl.int32) << 16
            # interleave(even codes, odd codes), recursively: the codes come out in k order
            u = tl.interleave(
                tl.interleave(tl.interleave(v & 7, (v >> 12) & 7), tl.interleave((v >> 6) & 7, (v >> 18) & 7)),
                tl.interleave(tl.interleave((v >> 3) & 7, (v >> 15) & 7), tl.interleave((v >> 9) & 7, (v >> 21) & 7)))
        # u − z exactly: 0x4B000000 | u is the float 2^23 + u (u < 2^23)
        w = (u | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)[:, None]
        xt = tl.load(x_rows[:, None] + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        if DOT:
            part = tl.dot(xt, tl.trans(w), input_precision="ieee")
        else:
            part = tl.sum(xt[:, None, :] * w[None, :, :], axis=2)
        acc += part * s[None, :]

    if HAS_BIAS:
        bias = tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += bias[None, :] * (pid_s == 0).to(tl.float32)  # once: in split 0's partial
    y = Y + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
    tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


@_jit
def _int8_kernel(X, sxm, W, swn, S, SX, Y, M, N, K, tiles_per_split,
                 INT_X: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W8A16 (INT_X false): y = s · Σ x·w in float32. W8A8 (INT_X true): int32 sums of
    xq·w, written as float32 sx·s·Σ without a split, as raw int32 partials with one."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = W + offs_n.to(tl.int64) * swn
    x_rows = X + offs_m.to(tl.int64) * sxm
    t_lo = pid_s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, tl.cdiv(K, BLOCK_K))

    if INT_X:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t in range(t_lo, t_hi):
        k = tl.multiple_of(t * BLOCK_K, BLOCK_K) + offs_k
        k_ok = k < K
        w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        xt = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        if INT_X:
            if DOT:
                acc = tl.dot(xt, tl.trans(w), acc, out_dtype=tl.int32)
            else:  # explicit int32 products (exact), summed over the step
                acc += tl.sum(xt.to(tl.int32)[:, None, :] * w.to(tl.int32)[None, :, :], axis=2)
        else:
            wf = w.to(tl.float32)
            xf = xt.to(tl.float32)
            if DOT:
                acc += tl.dot(xf, tl.trans(wf), input_precision="ieee")
            else:
                acc += tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)

    y = Y + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    s = tl.load(S + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if INT_X:
        if SPLIT:  # int32 partials, added exactly by the caller
            tl.store(y, acc, mask=out_ok)
        else:
            sx = tl.load(SX + offs_m, mask=m_ok, other=0.0).to(tl.float32)
            tl.store(y, acc.to(tl.float32) * sx[:, None] * s[None, :], mask=out_ok)
    else:
        tl.store(y, acc * s[None, :], mask=out_ok)


# ---- host side ------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


_SMS: dict = {}


def _sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _plan(M: int, N: int, k_steps: int, block_k: int, device, split_k: int | None, block_n: int | None):
    """(dot, BLOCK_M, BLOCK_N, m tiles, K steps per split, splits) for an [M, N] output."""
    dot = M > GEMV_MAX_M
    if dot:
        bm = min(64, max(16, _pow2(M)))
        bn, bn_min = 32, 16
    else:
        bm = _pow2(M)
        bn = max(8, min(MAX_BLOCK_N, GEMV_TILE // (bm * block_k)))
        bn_min = 8
    m_tiles = -(-M // bm)
    if block_n is not None:
        bn = block_n
    elif device.type == "cuda":  # at least 2 programs per SM where the rows allow it
        while bn > bn_min and -(-N // bn) * m_tiles < 2 * _sms(device):
            bn //= 2
    programs = -(-N // bn) * m_tiles
    if split_k is None:
        split_k = 1
        if device.type == "cuda" and k_steps >= 4 and programs < _sms(device):
            split_k = min(k_steps // 2, -(-2 * _sms(device) // programs))
    split_k = max(1, min(int(split_k), k_steps))
    per = -(-k_steps // split_k)
    return dot, bm, bn, m_tiles, per, -(-k_steps // per)


def _on(device):
    """Launch on ``device`` (Triton launches on the current CUDA device, not the tensors')."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _check_device(name: str, tensors) -> torch.device:
    dev = tensors[0][1].device
    if triton is None:
        raise ValueError(f"the Triton {name} kernel needs triton (pip install 'lessmem[gpu]')")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton {name} kernel runs on CUDA tensors ({tensors[0][0]} is on {dev}), or "
                         "on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton "
                         "is imported)")
    for what, t in tensors[1:]:
        if t is not None and t.device != dev:
            raise ValueError(f"{name}: {what} is on {t.device}, {tensors[0][0]} on {dev}; allowed: "
                             f"every tensor on {tensors[0][0]}'s device")
    return dev


def _float_rows(op: str, x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: {name} {shape}; allowed: a 2-D tensor [M, K]")
    if x.dtype == torch.float64:
        x = x.float()
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{op}: {name} dtype {x.dtype}; allowed: float32, float16, bfloat16 "
                         "(float64 is cast to float32)")
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _dtype(op: str, name: str, t: torch.Tensor, want: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} is a {type(t).__name__}; allowed: a {want} tensor")
    if t.dtype != want:
        raise ValueError(f"{op}: {name} dtype {t.dtype}; allowed: {want}")


def _check_lowbit(x, codes, bits, scale, zero, group_size, bias):
    op = "lowbit_linear"
    if isinstance(bits, bool) or bits not in LOWBIT_BITS:
        raise ValueError(f"{op}: bits={bits!r}; allowed: 2, 3, 4")
    x = _float_rows(op, x)
    _dtype(op, "scale", scale, torch.float16)
    _dtype(op, "zero", zero, torch.uint8)
    _dtype(op, "codes", codes, torch.uint8)
    m, k = x.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not lowbit_supported(k, group_size):
        raise ValueError(f"{op}: group_size={group_size!r} with in_features K={k}; allowed: a positive "
                         "multiple of 32 that divides K")
    g = k // group_size
    if scale.dim() != 2 or scale.shape[1] != g or zero.shape != scale.shape:
        raise ValueError(f"{op}: scale {tuple(scale.shape)} / zero {tuple(zero.shape)}; allowed: both "
                         f"[N, K / group_size] = [N, {g}]")
    n = scale.shape[0]
    row_bytes = k * bits // 8
    if codes.numel() < n * row_bytes or (codes.dim() == 2 and tuple(codes.shape) != (n, row_bytes)):
        raise ValueError(f"{op}: codes {tuple(codes.shape)} ({codes.numel()} bytes); allowed: "
                         f"pack_bits(u [N, K], bits), flat with N·K·bits/8 = {n * row_bytes} bytes or "
                         f"[N, K·bits/8] = [{n}, {row_bytes}]")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.numel() != n:
            what = f"{bias.dtype} with {bias.numel()} values" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"{op}: bias {what}; allowed: None or a float tensor of N = {n} values")
    _check_device(op, [("x", x), ("codes", codes), ("scale", scale), ("zero", zero), ("bias", bias)])
    return x, n, row_bytes


def _lowbit(x, codes, bits, scale, zero, group_size, bias=None, split_k=None, block_n=None):
    """``lowbit_linear`` with the launch plan's knobs (tests; None: the device's defaults)."""
    x, n, row_bytes = _check_lowbit(x, codes, bits, scale, zero, group_size, bias)
    m, k = x.shape
    dev = x.device
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.float32, device=dev)
    dot = m > GEMV_MAX_M
    block_k = min(group_size & -group_size, DOT_BLOCK_K if dot else GEMV_BLOCK_K)
    dot, bm, bn, m_tiles, per, splits = _plan(m, n, k // block_k, block_k, dev, split_k, block_n)
    codes = codes.reshape(-1)
    if not codes.is_contiguous():
        codes = codes.contiguous()
    scale, zero = scale.contiguous(), zero.contiguous()
    if bias is not None:
        bias = bias.reshape(-1).contiguous()
    y = torch.empty(splits, m, n, dtype=torch.float32, device=dev)
    grid = (-(-n // bn), m_tiles, splits)
    with _on(dev):
        _lowbit_kernel[grid](x, x.stride(0), codes, row_bytes, scale, zero, k // group_size, group_size,
                             bias if bias is not None else scale, y, m, n, per,
                             BITS=bits, HAS_BIAS=bias is not None, DOT=dot,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, num_warps=4)
    return y[0] if splits == 1 else y.sum(0)


def lowbit_linear(x: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor,
                  zero: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[M, N]`` = Σ_g scale[n, g] · Σ_{k∈g} x[m, k] · (u[n, k] − zero[n, g]) (+ bias).

    ``x [M, K]`` float32/float16/bfloat16, ``codes = pack_bits(u [N, K], bits)`` (flat, or
    ``[N, K·bits/8]``) uint8, ``bits`` 2, 3 or 4, ``scale [N, G]`` fp16, ``zero [N, G]`` uint8
    with ``G = K / group_size``, group_size a multiple of 32; optional float ``bias [N]``.
    All on one CUDA device (or CPU under Triton's interpreter).
    """
    return _lowbit(x, codes, bits, scale, zero, group_size, bias)


def _check_int8_weight(op, w, scale, k, xname):
    _dtype(op, "w", w, torch.int8)
    _dtype(op, "scale", scale, torch.float16)
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"{op}: w {tuple(w.shape)} for {xname} with K={k} input features; allowed: "
                         f"int8 [N, {k}]")
    if scale.numel() != w.shape[0]:
        raise ValueError(f"{op}: scale {tuple(scale.shape)}; allowed: fp16 with one value per row of w "
                         f"(N = {w.shape[0]})")


def _int8_launch(x, w, scale, sx, split_k, block_n):
    m, k = x.shape
    n = w.shape[0]
    dev = x.device
    int_x = sx is not None
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.float32, device=dev)
    if w.stride(-1) != 1:
        w = w.contiguous()
    scale = scale.reshape(-1).contiguous()
    dot = m > GEMV_MAX_M
    block_k = DOT_BLOCK_K if dot else GEMV_BLOCK_K
    dot, bm, bn, m_tiles, per, splits = _plan(m, n, -(-k // block_k), block_k, dev, split_k, block_n)
    part_int = int_x and splits > 1
    y = torch.empty(splits, m, n, dtype=torch.int32 if part_int else torch.float32, device=dev)
    grid = (-(-n // bn), m_tiles, splits)
    with _on(dev):
        _int8_kernel[grid](x, x.stride(0), w, w.stride(0), scale, sx if int_x else scale, y, m, n, k, per,
                           INT_X=int_x, SPLIT=splits > 1, DOT=dot, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
                           num_warps=4)
    if splits == 1:
        return y[0]
    if part_int:  # exact: the int32 partials added as int64, then scaled as the kernel does
        return y.sum(0, dtype=torch.int64).float() * sx[:, None] * scale.float()[None, :]
    return y.sum(0)


def _int8(x, w, scale, split_k=None, block_n=None):
    op = "int8_linear"
    x = _float_rows(op, x)
    _check_int8_weight(op, w, scale, x.shape[1], "x")
    _check_device(op, [("x", x), ("w", w), ("scale", scale)])
    return _int8_launch(x, w, scale, None, split_k, block_n)


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[M, N]`` = scale[n] · Σ_k x[m, k] · w[n, k] (W8A16): ``x [M, K]``
    float32/float16/bfloat16, ``w [N, K]`` int8, ``scale`` fp16 with N values."""
    return _int8(x, w, scale)


def _w8a8(xq, sx, w, scale, split_k=None, block_n=None):
    op = "w8a8_linear"
    _dtype(op, "xq", xq, torch.int8)
    _dtype(op, "sx", sx, torch.float32)
    if xq.dim() != 2:
        raise ValueError(f"{op}: xq {tuple(xq.shape)}; allowed: int8 [M, K]")
    m, k = xq.shape
    _check_int8_weight(op, w, scale, k, "xq")
    if sx.numel() != m:
        raise ValueError(f"{op}: sx {tuple(sx.shape)}; allowed: float32 with one value per row of xq (M = {m})")
    if k > W8A8_MAX_K:
        raise ValueError(f"{op}: K={k} input features; allowed: at most {W8A8_MAX_K} (int32 sums)")
    _check_device(op, [("xq", xq), ("sx", sx), ("w", w), ("scale", scale)])
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    return _int8_launch(xq, w, scale, sx.reshape(-1).contiguous(), split_k, block_n)


def w8a8_linear(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[M, N]`` = sx[m] · scale[n] · Σ_k xq[m, k] · w[n, k], the sum exact (int32):
    ``xq [M, K]`` int8, ``sx`` float32 with M values, ``w [N, K]`` int8, ``scale`` fp16 with N
    values, K ≤ 131072."""
    return _w8a8(xq, sx, w, scale)
