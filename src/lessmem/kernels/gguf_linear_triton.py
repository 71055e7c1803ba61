"""Fused GGUF dequant-matmul in Triton (the CUDA backend): ``y = x · W_hatᵀ`` from raw blocks.

``gguf_linear(x, raw, qtype, out_features, bias=None)`` returns float32 ``[M, N]`` (``[..., N]``
for ``x [..., K]``) with the weight ``W [N, K]`` held as the bytes a ``.gguf`` file stores
(uint8 ``[N, K / block_size * type_size]``): the same values as
:func:`~lessmem.kernels.gguf_linear_cpp.gguf_linear`, without a float copy of the weight.
``gguf_dequantize(raw, qtype, out_features, in_features)`` writes ``W_hat`` float32
``[N, K]`` out (big batches: decode once, then cuBLAS). Block types: ``SUPPORTED`` (all ten
of ``formats.gguf``); a type outside it raises ``NotImplementedError`` naming it, and the
caller runs the torch fallback of ``gguf_linear_torch``.

Kernel (decode GEMV, M = 1..16 rows, memory-bound): one program per ``BLOCK_N`` weight rows
× ``BLOCK_M`` input rows × split of K. It walks its rows 256 weights at a time (one K-quant
super-block, or 8 legacy blocks of 32). A step's weights are ``P`` parts of an ``[A, L]``
tile per row (``TILES``) that share their code bytes: each code byte is loaded once and
every part takes its bits from it with shifts and masks (the low / high nibble of a 4-bit
code byte, the four 2-bit fields of a Q2_K/Q3_K byte or of a Q6_K ``qh`` byte, the bit
planes of Q3_K/Q5_K). Header fields are loaded once per block (fp16 ``d`` / ``dmin`` read
as two bytes combined into a uint16 and bitcast to fp16: Q4_0 blocks are 18 bytes, Q6_K 210,
so the fields are only 2-byte aligned), sub-block scales and mins once per part (unpacked
from their 6-/4-bit or int8 fields). Codes become floats without an int→float conversion
instruction (``_fl``: exact), and each weight is formed with the float32 operations of
``gguf_linear_torch``'s decoder for the type, in the same order:

    Q4_0 d·(q − 8)    Q4_1 d·q + m    Q5_0 d·(q − 16)    Q5_1 d·q + m    Q8_0 q·d
    Q2_K (d·sc)·q − (dmin·m)    Q3_K (d·(sc − 32))·q    Q4_K/Q5_K (d·sc)·q − (dmin·m)
    Q6_K (d·sc)·(q − 32)

The kernels are compiled with ``enable_fp_fusion=False`` so no multiply-add is contracted
there (the products are exact anyway: an fp16 times a code of at most 8 bits fits in
float32's 24-bit significand), hence weights bit-identical to ``gguf_dequantize_torch`` /
``formats.gguf.dequantize_gguf``. Each part is multiplied by its slice of x (fp32/fp16/bf16,
converted to float32 in the kernel) into one ``[BLOCK_M, BLOCK_N, A, L]`` float32
accumulator with explicit ``tl.fma``; it is summed once, after the last step, and the bias
added. ``y`` therefore equals the float64 reference to float32 rounding (sums in another
order), not bit for bit. On CUDA, when the row tiles alone would leave the SMs under-filled
(few rows, long K), K is split over more programs (``_plan``); their partial sums go to a
``[split, M, N]`` buffer that ``torch.sum`` reduces (deterministic, no atomics).

Tile shapes were checked by compiling for sm_90 (H100/H200) on a machine without a GPU
(PTX, ptxas, no spills; see ``_linear`` for the layout choices) but not timed: ``BLOCK_N``,
``BLOCK_M``, ``NUM_WARPS`` and the split are reasoned, not tuned on a GPU.

Layouts (per block, byte offsets; element ``e`` of the block) follow llama.cpp's
``ggml-quants.c`` (``block_q*`` structs, ``dequantize_row_q*``) — also what ggml's CUDA
``mmvq`` / ``vecdotq.cuh`` read — as described in ``formats.gguf``, ``gguf_legacy`` and
``gguf_kquants``: legacy codes in 16 bytes, low nibbles = elements 0-15, high = 16-31, the
5th bit of Q5_x at bit ``e`` of a little-endian u32; K-quant 2-bit codes at bits ``2k`` of
byte ``32h + l`` for element ``128h + 32k + l``, 4-bit codes per 32 bytes low nibbles then
high nibbles, Q3_K/Q5_K high bits in bit planes (bit ``j`` of byte ``l`` for element
``32j + l``), Q6_K low nibbles per 64 bytes and 2 high bits per 32 bytes of ``qh``,
``get_scale_min_k4``'s 12-byte packing of eight 6-bit scales and mins, Q3_K's 4+2-bit
scales. The code is written from those descriptions, not copied.

On CUDA tensors the kernels are compiled by Triton. With ``TRITON_INTERPRET=1`` set before
triton is imported they run on CPU tensors under Triton's interpreter:
``tests/kernels/test_triton_gguf_linear.py`` checks them against ``gguf_linear_reference``
and ``gguf_linear_torch`` that way, in a subprocess, on machines without a GPU.

Example:
    >>> import torch  # doctest: +SKIP
    >>> from lessmem.formats.gguf import quantize_gguf  # doctest: +SKIP
    >>> from lessmem.kernels.gguf_linear_triton import gguf_linear  # doctest: +SKIP
    >>> raw = torch.from_numpy(quantize_gguf(torch.randn(64, 256), "q4_k")).cuda()  # doctest: +SKIP
    >>> y = gguf_linear(torch.randn(1, 256, device="cuda"), raw, "q4_k", 64)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..formats.gguf import gguf_type
from ._triton import available, interpreting, tl, triton  # noqa: F401  (available: public)
from ._triton import jit as _jit

SUPPORTED = ("q4_0", "q8_0", "q4_k", "q6_k", "q4_1", "q5_0", "q5_1", "q5_k", "q2_k", "q3_k")
STEP = 256  # weights of a row per loop step: one super-block, or 8 legacy blocks of 32
# A step's 256 weights as P parts of an [A, L] tile: the parts share their code bytes, so each
# code byte is loaded once (see _elem for which weight sits where)
TILES = {"q4_0": (8, 16, 2), "q4_1": (8, 16, 2), "q5_0": (8, 16, 2), "q5_1": (8, 16, 2),
         "q8_0": (8, 32, 1), "q2_k": (4, 16, 4), "q3_k": (4, 16, 4), "q4_k": (4, 32, 2),
         "q5_k": (4, 32, 2), "q6_k": (4, 16, 4)}
MAX_BLOCK_M = 16  # input rows per program; more rows take more programs along M
# BLOCK_N: the accumulator (BLOCK_M · BLOCK_N · A · L floats) at most ACC_WEIGHTS, a part's
# weight tile (BLOCK_N · A · L) at most PART_WEIGHTS: 16 and 8 values a thread at 4 warps.
# (Compiled for sm_90, larger weight tiles made Triton pick the layout of the scale loads for
# the accumulator and move every decoded tile through shared memory.)
ACC_WEIGHTS = 2048
PART_WEIGHTS = 1024
NUM_WARPS = 4
PROGRAMS_PER_SM = 8  # split K until about this many programs per SM (CUDA only)
MIN_STEPS_PER_SPLIT = 4
DEQ_BLOCK_N = 8  # rows per program of the dequantize kernel (one step each)
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@_jit
def _byte(p, ok):
    """The bytes at ``p`` as int32 0..255 (0 where masked off)."""
    return tl.load(p, mask=ok, other=0).to(tl.int32)


@_jit
def _f16(p, ok):
    """The little-endian fp16 field at ``p`` (any alignment: two byte loads) as float32."""
    v = _byte(p, ok) | (_byte(p + 1, ok) << 8)
    return v.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _fl(q, OFF: tl.constexpr):
    """float32(q − OFF) for int32 0 ≤ q < 2²³, exactly: 2²³ + q built from its bits, minus
    2²³ + OFF (both exact, their difference too), so no int→float conversion (a quarter-rate
    instruction on NVIDIA GPUs) runs per weight. Same value as ``q.float() - OFF``, +0.0 at 0."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFF)


@_jit
def _elem(a, l, P_IX: tl.constexpr, QT: tl.constexpr):
    """Index in its step (0..255) of the weight at tile position (a, l) of part ``P_IX``."""
    if QT == 8:  # Q8_0: block a, byte l
        e = 32 * a + l
    elif QT < 10:  # legacy nibbles: block a, low (part 0) / high (part 1) nibble of byte l
        e = 32 * a + 16 * P_IX + l
    elif QT == 12 or QT == 13:  # Q4_K/Q5_K: 64-chunk a, low / high nibble of qs byte 32a + l
        e = 64 * a + 32 * P_IX + l
    else:  # Q2_K/Q3_K/Q6_K: half a // 2, bits of part P_IX at 32·P_IX of the half
        e = 128 * (a // 2) + 16 * (a % 2) + 32 * P_IX + l
    return e


@_jit
def _codes(blk, ok, a, l, QT: tl.constexpr):
    """The step's code bytes, loaded once for all parts: up to three ``[…, A, L]`` tiles
    (the legacy 5th bits as one u32 per block); unused ones repeat the first."""
    if QT == 2:
        c0 = _byte(blk + 2 + l, ok)
        c1 = c0
        c2 = c0
    elif QT == 3:
        c0 = _byte(blk + 4 + l, ok)
        c1 = c0
        c2 = c0
    elif QT == 6 or QT == 7:  # qs, and qh[4] as a little-endian u32 [.., A, 1]
        qh = blk + 2 + 2 * (QT - 6)
        c0 = _byte(qh + 4 + l, ok)
        c1 = _byte(qh, ok) | (_byte(qh + 1, ok) << 8) | (_byte(qh + 2, ok) << 16) | (_byte(qh + 3, ok) << 24)
        c2 = c0
    elif QT == 8:
        c0 = _byte(blk + 2 + l, ok)
        c1 = c0
        c2 = c0
    elif QT == 10:  # qs: byte 16a + l holds the 2-bit codes of all 4 parts
        c0 = _byte(blk + 16 + 16 * a + l, ok)
        c1 = c0
        c2 = c0
    elif QT == 11:  # qs, hmask byte (element % 32)
        c0 = _byte(blk + 32 + 16 * a + l, ok)
        c1 = _byte(blk + 16 * (a % 2) + l, ok)
        c2 = c0
    elif QT == 12:
        c0 = _byte(blk + 16 + 32 * a + l, ok)
        c1 = c0
        c2 = c0
    elif QT == 13:  # qs, qh byte (element % 32)
        c0 = _byte(blk + 48 + 32 * a + l, ok)
        c1 = _byte(blk + 16 + l + 0 * a, ok)  # loaded at the tile's full shape, like c0
        c2 = c0
    else:  # Q6_K: ql bytes of the even / odd parts, qh byte (2 bits per part)
        c0 = _byte(blk + 64 * (a // 2) + 16 * (a % 2) + l, ok)
        c1 = _byte(blk + 64 * (a // 2) + 32 + 16 * (a % 2) + l, ok)
        c2 = _byte(blk + 128 + 16 * a + l, ok)
    return c0, c1, c2


@_jit
def _head(blk, ok, QT: tl.constexpr):
    """The block's (d, m) or super-block's (d, dmin) as float32 (m/dmin repeat d if absent)."""
    if QT == 10:
        h0 = _f16(blk + 80, ok)
        h1 = _f16(blk + 82, ok)
    elif QT == 11:
        h0 = _f16(blk + 108, ok)
        h1 = h0
    elif QT == 14:
        h0 = _f16(blk + 208, ok)
        h1 = h0
    else:
        h0 = _f16(blk, ok)
        if QT == 3 or QT == 7 or QT == 12 or QT == 13:
            h1 = _f16(blk + 2, ok)
        else:
            h1 = h0
    return h0, h1


@_jit
def _part(blk, ok, a, l, c0, c1, c2, h0, h1, P_IX: tl.constexpr, QT: tl.constexpr):
    """float32 weights ``[…, A, L]`` of part ``P_IX``, formed with the torch decoder's ops."""
    if QT == 2:  # Q4_0: d·(q − 8)
        w = h0 * _fl((c0 >> (4 * P_IX)) & 15, 8)
    elif QT == 3:  # Q4_1: d·q + m
        w = h0 * _fl((c0 >> (4 * P_IX)) & 15, 0) + h1
    elif QT == 6 or QT == 7:  # Q5_0: d·(q − 16); Q5_1: d·q + m; 5th bit = bit e of qh
        q = ((c0 >> (4 * P_IX)) & 15) | (((c1 >> (16 * P_IX + l)) & 1) << 4)
        if QT == 6:
            w = h0 * _fl(q, 16)
        else:
            w = h0 * _fl(q, 0) + h1
    elif QT == 8:  # Q8_0: q·d, q the int8 byte
        w = _fl(c0 ^ 128, 128) * h0
    elif QT == 10 or QT == 11 or QT == 14:  # sub-blocks of 16: j = element // 16
        j = 8 * (a // 2) + 2 * P_IX + a % 2
        if QT == 10:  # Q2_K: (d·sc)·q − (dmin·m), scale / min nibbles of byte j
            sc = _byte(blk + j, ok)
            dl = h0 * _fl(sc & 15, 0)
            ml = h1 * _fl(sc >> 4, 0)
            w = dl * _fl((c0 >> (2 * P_IX)) & 3, 0) - ml
        elif QT == 11:  # Q3_K: (d·(sc − 32))·q, q = 2 bits − 4·(1 − hmask bit)
            lo = _byte(blk + 96 + j % 8, ok)
            lo = tl.where(j < 8, lo & 15, lo >> 4)
            hi = (_byte(blk + 104 + j % 4, ok) >> (2 * (j // 4))) & 3
            dl = h0 * _fl(lo | (hi << 4), 32)
            q = ((c0 >> (2 * P_IX)) & 3) | (((c1 >> (4 * (a // 2) + P_IX)) & 1) << 2)
            w = dl * _fl(q, 4)
        else:  # Q6_K: (d·sc)·(q − 32), sc int8
            dd = h0 * _fl(_byte(blk + 192 + j, ok) ^ 128, 128)
            if P_IX % 2 == 0:
                ql = (c0 >> (4 * (P_IX // 2))) & 15
            else:
                ql = (c1 >> (4 * (P_IX // 2))) & 15
            w = dd * _fl(ql | (((c2 >> (2 * P_IX)) & 3) << 4), 32)
    else:  # Q4_K/Q5_K: (d·sc)·q − (dmin·m), 6-bit scale/min j of get_scale_min_k4
        j = 2 * a + P_IX
        k = j % 4
        sa = _byte(blk + 4 + k, ok)
        sb = _byte(blk + 8 + k, ok)
        scc = _byte(blk + 12 + k, ok)
        sc = tl.where(j < 4, sa & 63, (scc & 15) | ((sa >> 6) << 4))
        mn = tl.where(j < 4, sb & 63, (scc >> 4) | ((sb >> 6) << 4))
        dd = h0 * _fl(sc, 0)
        dm = h1 * _fl(mn, 0)
        q = (c0 >> (4 * P_IX)) & 15
        if QT == 13:
            q = q | (((c1 >> j) & 1) << 4)
        w = dd * _fl(q, 0) - dm
    return w


@_jit
def _blocks(base, row_ok, a, step, nb, QT: tl.constexpr, TS: tl.constexpr, A: tl.constexpr):
    """(block pointers, load mask) of one step of the rows whose first bytes are ``base``:
    legacy types ``[…, A, 1]`` (block a of the step; the last step may hold fewer), K-quants
    ``[…, 1, 1]`` (one super-block)."""
    if QT < 10:
        bi = step * A + a
        blk = base + bi * TS
        ok = row_ok & (bi < nb)
    else:
        blk = base + step * TS
        ok = row_ok
    return blk, ok


@_jit
def _linear(X, sxm, RAW, srow, BIAS, Y, M, N, n_steps, per_split, nb,
            QT: tl.constexpr, TS: tl.constexpr, A: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            X_FULL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Every tile is 4-D [BLOCK_M, BLOCK_N, A, L] (size 1 where it does not vary), shaped for
    # the compiler's layout choice. X_FULL (one input row, or x's tile larger than a part's
    # weights): x is loaded at the accumulator's full shape (repeats along BLOCK_N hit L1),
    # and its vectorized load sets the layout of the weights and accumulator too, each
    # thread holding runs along L (a block's scales loaded once per run; with one row no
    # tile changes layout at all). Otherwise x is loaded as [BLOCK_M, A, L] and widened
    # after the load, so the weights keep their loads' layout and only x's smaller tile
    # moves through shared memory.
    rows4 = rows[None, :, None, None]
    row_ok = rows4 < N
    base = RAW + rows4.to(tl.int64) * srow
    a4 = tl.arange(0, A)[None, None, :, None]
    l4 = tl.arange(0, L)[None, None, None, :]
    if X_FULL:
        xm = offs_m[:, None, None, None]
        xa = a4
        xl = l4
        xrow = X + xm.to(tl.int64) * sxm + 0 * rows4
    else:
        xm = offs_m[:, None, None]
        xa = tl.arange(0, A)[None, :, None]
        xl = tl.arange(0, L)[None, None, :]
        xrow = X + xm.to(tl.int64) * sxm
    s_lo = pid_k * per_split
    s_hi = tl.minimum(s_lo + per_split, n_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N, A, L), tl.float32)
    for step in range(s_lo, s_hi):
        blk, ok = _blocks(base, row_ok, a4, step, nb, QT, TS, A)
        c0, c1, c2 = _codes(blk, ok, a4, l4, QT)
        h0, h1 = _head(blk, ok, QT)
        if QT < 10:
            x_ok = (xm < M) & (step * A + xa < nb)
        else:
            x_ok = xm < M
        for p in tl.static_range(P):
            xv = tl.load(xrow + step * 256 + _elem(xa, xl, p, QT), mask=x_ok, other=0.0).to(tl.float32)
            w = _part(blk, ok, a4, l4, c0, c1, c2, h0, h1, p, QT)
            if X_FULL:
                acc = tl.fma(w, xv, acc)
            else:
                acc = tl.fma(w, xv[:, None, :, :], acc)
    y = tl.sum(tl.sum(acc, 3), 2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        b = tl.load(BIAS + rows, mask=rows < N, other=0.0).to(tl.float32)
        y += tl.where(pid_k == 0, b, 0.0)[None, :]
    out = Y + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + rows[None, :]
    tl.store(out, y, mask=(offs_m < M)[:, None] & (rows < N)[None, :])


@_jit
def _dequant(RAW, srow, OUT, N, K, nb,
             QT: tl.constexpr, TS: tl.constexpr, A: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
             BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    step = tl.program_id(1)
    rows3 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None, None]
    a = tl.arange(0, A)[None, :, None]
    l = tl.arange(0, L)[None, None, :]
    blk, ok = _blocks(RAW + rows3.to(tl.int64) * srow, rows3 < N, a, step, nb, QT, TS, A)
    c0, c1, c2 = _codes(blk, ok, a, l, QT)
    h0, h1 = _head(blk, ok, QT)
    out = OUT + rows3.to(tl.int64) * K + step * 256
    for p in tl.static_range(P):
        w = _part(blk, ok, a, l, c0, c1, c2, h0, h1, p, QT)
        tl.store(out + _elem(a, l, p, QT), w, mask=ok)


# ---------------------------------------------------------------- host side

def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan(m: int, n: int, n_steps: int, tile: int, device, split: int | None = None):
    """(BLOCK_M, BLOCK_N, steps per split, splits) for an ``[m, K] · [n, K]ᵀ`` product whose
    weight tile per step and part is ``tile`` (A·L) weights."""
    bm = min(_pow2(m), MAX_BLOCK_M)
    bn = max(1, min(PART_WEIGHTS // tile, ACC_WEIGHTS // (bm * tile)))
    if split is None:
        split = 1
        if device.type == "cuda":  # fill the SMs: split K when the row tiles are too few
            tiles = -(-n // bn) * -(-m // bm)
            want = -(-PROGRAMS_PER_SM * _sm_count(device.index or 0) // tiles)
            split = max(1, min(want, n_steps // MIN_STEPS_PER_SPLIT))
    split = max(1, min(int(split), n_steps))
    per = -(-n_steps // split)
    return bm, bn, per, -(-n_steps // per)


def _on(device):
    """Triton launches on the current CUDA device: make it ``device`` for the launch when it
    is another GPU (a no-op context otherwise)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _check_type(qtype):
    t = gguf_type(qtype)  # ValueError naming the known types
    if t.name not in SUPPORTED:
        raise NotImplementedError(f"the Triton GGUF kernel does not decode {t.name.upper()}; "
                                  f"supported: {', '.join(SUPPORTED)}")
    return t


def _check_device(what: str, *tensors) -> None:
    if triton is None:
        raise ValueError(f"the Triton GGUF {what} kernel needs triton (pip install 'lessmem[gpu]')")
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"tensors on {t.device} and {dev}; allowed: all on one device")
    if dev.type == "cpu" and not interpreting():
        raise ValueError(f"the Triton GGUF {what} kernel runs on GPU tensors (these are on cpu), "
                         "or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set "
                         "before triton is imported)")


def _check_raw(raw, t, n, k) -> int:
    """Validate raw against ``[n, k]`` in type t; returns the row stride in bytes."""
    if k != int(k) or k <= 0 or k % t.block_size:
        raise ValueError(f"in_features={k}; allowed: a positive multiple of the {t.name.upper()} "
                         f"block size {t.block_size}")
    if n != int(n) or n <= 0:
        raise ValueError(f"out_features={n}; allowed: a positive integer")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF blocks of dtype {getattr(raw, 'dtype', type(raw).__name__)}; "
                         "allowed: a uint8 torch.Tensor")
    row_bytes = k // t.block_size * t.type_size
    if raw.numel() != n * row_bytes:
        raise ValueError(f"raw holds {raw.numel()} bytes; [{n}, {k}] in {t.name.upper()} needs "
                         f"{n * row_bytes} ({k // t.block_size} blocks of {t.type_size} bytes per row)")
    if raw.is_contiguous():
        return row_bytes
    if raw.dim() == 2 and raw.shape[1] == row_bytes and raw.stride(1) == 1:
        return raw.stride(0)  # rows of a bigger buffer, read in place
    raise ValueError(f"raw has shape {tuple(raw.shape)} and strides {raw.stride()}; allowed: "
                     f"contiguous, or [{n}, {row_bytes}] rows with unit column stride")


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x [M, K] @ W_hat.T (+ bias)`` (``[..., N]`` for ``x [..., K]``) with W as raw
    GGUF rows ``[N, K / block_size * type_size]`` on x's device (CUDA: compiled; CPU:
    Triton's interpreter). ``qtype``: a name ("q4_k"), ggml id or GGUFType in ``SUPPORTED``."""
    return _gguf_linear(x, raw, qtype, out_features, bias)


def _gguf_linear(x, raw, qtype, out_features, bias=None, split: int | None = None):
    """``gguf_linear`` with the K split forced to ``split`` (tests; None: the plan's)."""
    t = _check_type(qtype)
    if not isinstance(x, torch.Tensor) or x.dtype not in X_DTYPES or x.dim() < 1:
        raise ValueError(f"x of dtype {getattr(x, 'dtype', type(x).__name__)}, "
                         f"{getattr(x, 'dim', lambda: '?')()} dims; allowed: float32, float16 or "
                         "bfloat16 with at least 1 dim [..., K]")
    n, k = out_features, x.shape[-1]
    srow = _check_raw(raw, t, n, k)
    n = int(n)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.numel() != n or not bias.is_floating_point():
            raise ValueError(f"bias of {getattr(bias, 'numel', lambda: '?')()} values, dtype "
                             f"{getattr(bias, 'dtype', type(bias).__name__)}; allowed: {n} floats "
                             "(out_features)")
        bias = bias.reshape(-1).contiguous()
    _check_device("linear", x, raw, *([bias] if bias is not None else []))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return torch.zeros(*lead, n, dtype=torch.float32, device=x.device)
    a, l, p = TILES[t.name]
    n_steps = -(-k // STEP)
    bm, bn, per, split = _plan(m, n, n_steps, a * l, x.device, split)
    y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    with _on(x.device):
        _linear[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
            x2, x2.stride(0), raw, srow, bias if bias is not None else y, y, m, n, n_steps, per,
            k // t.block_size, QT=t.ggml_id, TS=t.type_size, A=a, L=l, P=p,
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, X_FULL=bm == 1 or bm > bn,
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    y = y[0] if split == 1 else y.sum(0)
    return y.view(*lead, n)


def gguf_dequantize(raw: torch.Tensor, qtype, out_features: int, in_features: int) -> torch.Tensor:
    """float32 ``W_hat [N, K]`` decoded on raw's device, bit-identical to
    ``gguf_linear_torch.gguf_dequantize_torch`` (and ``formats.gguf.dequantize_gguf``)."""
    t = _check_type(qtype)
    srow = _check_raw(raw, t, out_features, in_features)
    _check_device("dequantize", raw)
    n, k = int(out_features), int(in_features)
    a, l, p = TILES[t.name]
    out = torch.empty(n, k, dtype=torch.float32, device=raw.device)
    with _on(raw.device):
        _dequant[(triton.cdiv(n, DEQ_BLOCK_N), -(-k // STEP))](
            raw, srow, out, n, k, k // t.block_size, QT=t.ggml_id, TS=t.type_size, A=a, L=l,
            P=p, BLOCK_N=DEQ_BLOCK_N, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
