"""Triton quantize-on-append for the KV cache: one chunk ``x [B, H, T, D]`` straight into
its stored layout.

``encode(x, spec, layout=None)`` returns the same :class:`~lessmem.kvcache.codec.Encoded`
as :func:`lessmem.kvcache.codec.encode` (codes, scale and zero point bit for bit; see
"Exactness" below for the one exception) from ONE kernel launch: each program loads a
tile of x (fp32, fp16 or bf16, widened to fp32 in registers), reduces each group's
statistics, rounds the scale to fp16 (and picks the zero point), computes the codes and
writes the packed code bytes, the scales and the zero points into freshly allocated
tensors of the layout's part shapes. Nothing the size of x is written but the codes.

The tile is held in the layout's packing order, ``[rows, A, C]`` for one ``(b, h)``:

- ``split`` packing (bits dividing 8, p = 8 / bits codes per byte, N = D / p bytes a row):
  channel ``a·N + c`` at slot a of byte c, so a row's bytes are ``Σ_a code[:, a, c] << bits·a``
  (at 8 bits p = 1: a byte is a code);
- ``stream`` packing (any bits): channel ``8·a + c``, the 8 codes of octet a make one
  ``8·bits``-bit little-endian word, stored as ``bits`` bytes.

Groups are reduced in that order: per channel (``token_group`` > 1, one program per token
group: over the rows), a whole row (``channel_group`` = D), one element (group 1), or a
run of ``channel_group`` channels that lies along C (it divides N, or 8) or spans whole
A slots (a multiple of N, or 8) via a reshape. A geometry none of these covers (only
non-power-of-two head dims with an unusual channel group can) raises NotImplementedError.

Formats (:data:`SUPPORTED_FORMATS`, the quantizers of ``codec.FORMATS``):

- ``int`` (symmetric): ``s = fp16(clamp(where(a > 0, a, 1), tiny, 65504))`` with
  ``a = max|x| · clip / qmax``; ``code = clamp(round(x / s), -qmax, qmax) + 2^(b−1)``;
- ``uint``: ``lo = min(x, 0) · clip``, ``hi = max(x, 0) · clip``, the same fp16 store of
  ``(hi − lo) / (2^b − 1)`` rounded *up* (``nextafter`` when the nearest fp16 is below),
  ``z = clamp(round(−lo / s), 0, 2^b − 1)``, ``code = clamp(round(x / s) + z, 0, 2^b − 1)``;
- ``fp8-e4m3`` / ``fp8-e5m2``: ``s = fp16(where(a > 0, a / fmax, 1))`` with
  ``a = max|x| · clip``, the byte of ``clamp(x / s, ±fmax)`` converted with torch's own
  bit-level rounding (round to nearest even, NaN as 0x7F with the sign);
- ``lm`` (Lloyd-Max levels): ``s = fp16(where(r > 0, r, 1))`` with
  ``r = sqrt(mean(x²)) · clip``; the code counts the decision boundaries
  (``formats.codebook.midpoints_below``) strictly below ``x / s``, as ``assign`` does.

Exactness: every operation is the one codec does, in float32 and in the same order;
divisions use ``tl.div_rn`` and square roots ``tl.sqrt_rn`` (Triton's ``/`` and
``tl.sqrt`` are approximate on CUDA), ``round`` is round-half-to-even built from
``floor`` (identical on the GPU and under the interpreter), fp16 conversions round to
nearest even, and the launch disables mul+add fusion (``enable_fp_fusion=False``).
Torch divides a tensor by a Python number differently per device (CPU: ``a / b``; CUDA:
``a · fp32(1 / b)``), so the kernel does what torch does on x's device: on CUDA it
matches ``codec.encode`` run on CUDA tensors, under the interpreter on CPU tensors. Max,
min, clamps and compares are order-free, so int, uint and fp8 are bit-exact. The one
exception is ``lm``: its scale needs ``mean(x²)``, a float32 *sum* whose order differs
from torch's (torch's own order differs between CPU vector widths and CUDA), so its
fp32 RMS can differ in the last bits; after the fp16 rounding the stored scale differs by
one fp16 ulp in about one group in ten thousand, and the codes of those groups may then
differ too. Everywhere else (the same scale) the lm codes are identical. NaN in x is not
covered (Triton's min/max and torch's amax/clamp treat NaN differently); the NaN of
``0 / 0`` in an fp8 group whose scale underflows to 0 is (torch's clamp keeps it).

On CUDA tensors the kernel is compiled by Triton; with ``TRITON_INTERPRET=1`` set before
triton is imported it runs on CPU tensors under Triton's interpreter
(``tests/kernels/test_triton_kv_store.py`` checks it against ``codec.encode`` that way).

Example:
    >>> from lessmem.kvcache.presets import resolve  # doctest: +SKIP
    >>> from lessmem.kvcache.store_triton import encode  # doctest: +SKIP
    >>> enc = encode(k_chunk.cuda(), resolve("kivi-4").keys)  # doctest: +SKIP
    >>> enc.codes.shape, enc.scale.shape, enc.zero_point.shape  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..formats.codebook import midpoints_below
from ..formats.integer import _TINY
from ..kernels._triton import available, interpreting, tl, triton  # noqa: F401  (available: public)
from ..kernels._triton import jit as _jit
from .codec import Encoded, kv_layout
from .config import KVTensorConfig

# format -> the kernel's FMT constant
SUPPORTED_FORMATS = {"int": 0, "uint": 1, "lm": 2, "fp8-e4m3": 3, "fp8-e5m2": 4}
PACKINGS = {"split": 0, "stream": 1}  # KVLayout.packing -> the kernel's STREAM constant
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FMAX = {"fp8-e4m3": float(torch.finfo(torch.float8_e4m3fn).max),
         "fp8-e5m2": float(torch.finfo(torch.float8_e5m2).max)}
# group reduction modes (the kernel's MODE constant)
_PER_CHANNEL, _ROW, _ELEMENT, _ALONG_C, _SPAN_A = range(5)
_TILE = 4096  # x elements per program (compiled); the interpreter takes bigger tiles
_TILE_INTERPRETED = 16384


@_jit
def _red(v, axis: tl.constexpr, KIND: tl.constexpr):
    if KIND == 0:
        r = tl.max(v, axis)
    elif KIND == 1:
        r = tl.min(v, axis)
    else:
        r = tl.sum(v, axis)
    return r


@_jit
def _group(v, KIND: tl.constexpr, MODE: tl.constexpr, DG: tl.constexpr, K: tl.constexpr,
           BR: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr):
    """Each group's max (KIND 0), min (1) or sum (2) of the tile ``v [BR, BA, BC]``, in a
    shape that broadcasts against v (padding holds 0, which none of the uses notices)."""
    if MODE == 0:  # per channel: the tile's rows are the group's tokens
        r = _red(v, 0, KIND)[None, :, :]
    elif MODE == 1:  # the whole row
        r = _red(_red(v, 2, KIND), 1, KIND)[:, None, None]
    elif MODE == 2:  # one element
        r = v
    elif MODE == 3:  # DG consecutive positions along C
        w = _red(tl.reshape(v, (BR, BA, BC // DG, DG)), 3, KIND)
        r = tl.reshape(tl.broadcast_to(w[:, :, :, None], (BR, BA, BC // DG, DG)), (BR, BA, BC))
    else:  # K whole consecutive rows of A
        w = _red(_red(tl.reshape(v, (BR, BA // K, K, BC)), 3, KIND), 2, KIND)
        r = tl.reshape(tl.broadcast_to(w[:, :, None, None], (BR, BA // K, K, BC)), (BR, BA, BC))
    return r


@_jit
def _rint(v):
    """round half to even (torch.round), from floor: the same on the GPU and the interpreter."""
    f = tl.floor(v)
    d = v - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@_jit
def _by_const(a, q, inv_q, RECIP: tl.constexpr):
    """``a / q`` for a Python-number q as torch computes it: CUDA ``a · fp32(1/q)``, CPU ``a / q``."""
    if RECIP:
        r = a * inv_q
    else:
        r = tl.div_rn(a, q)
    return r


@_jit
def _fp8_bits(y, E5M2: tl.constexpr):
    """torch's float32 -> fp8 byte (c10 fp8e4m3fn/fp8e5m2_from_fp32_value), as int32."""
    b = y.to(tl.int32, bitcast=True)
    fb = b & 0x7FFFFFFF
    if E5M2:
        denorm = tl.full(y.shape, 134 << 23, tl.int32)
        den = (fb.to(tl.float32, bitcast=True) + denorm.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        den = den - (134 << 23)
        nrm = (fb + (((15 - 127) << 23) + 0xFFFFF) + ((fb >> 21) & 1)) >> 21
        sat = tl.where(fb > (255 << 23), 0x7F, 0x7C)
        r = tl.where(fb >= (143 << 23), sat, tl.where(fb < (113 << 23), den, nrm))
    else:
        denorm = tl.full(y.shape, 141 << 23, tl.int32)
        den = (fb.to(tl.float32, bitcast=True) + denorm.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        den = den - (141 << 23)
        nrm = (fb + (((7 - 127) << 23) + 0x7FFFF) + ((fb >> 20) & 1)) >> 20
        r = tl.where(fb >= (1087 << 20), 0x7F, tl.where(fb < (121 << 23), den, nrm))
    return (r & 0x7F) | tl.where(b < 0, 0x80, 0)


@_jit
def _encode_kernel(X, sx_b, sx_h, sx_t, sx_d, CODES, SCALE, ZP, MID,
                   H, T, n_srows, clip, qf, inv_q, n_el, inv_n,
                   FMT: tl.constexpr, BITS: tl.constexpr, STREAM: tl.constexpr, D: tl.constexpr,
                   TG: tl.constexpr, DG: tl.constexpr, MODE: tl.constexpr, K: tl.constexpr,
                   RECIP: tl.constexpr, TINY: tl.constexpr, N_MID: tl.constexpr,
                   BR: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr):
    blk = tl.program_id(0)  # token block (or token group): the axis that can grow large
    bh = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    b = bh // H
    h = bh % H
    RB: tl.constexpr = D * BITS // 8  # bytes of a code row
    NG: tl.constexpr = D // DG  # scale columns

    # ---- the tile [BR, BA, BC]: rows r (tokens), channel of (a, c) in packing order
    r = tl.arange(0, BR)[:, None, None]
    a = tl.arange(0, BA)[None, :, None]
    c = tl.arange(0, BC)[None, None, :]
    if TG > 1:  # one token group per program, its rows padded to BR
        t = blk * TG + r
        row_ok = r < TG
    else:
        t = blk * BR + r
        row_ok = t < T
    if STREAM:  # channel 8·a + c; tiles of BA octets
        a = a + tile * BA
        ch = a * 8 + c
        ch_ok = ch < D
    else:  # channel a·N + c (N = RB bytes a row, BITS·a the slot's shift); tiles of BC bytes
        c = c + tile * BC
        ch = a * RB + c
        ch_ok = c < RB
    ok = row_ok & ch_ok
    x = tl.load(X + b * sx_b + h * sx_h + t * sx_t + ch * sx_d, mask=ok, other=0.0).to(tl.float32)

    # ---- scale (fp16, as stored), zero point and codes
    if FMT <= 1:  # int (symmetric) / uint: formats.integer.choose_qparams + quantize_grouped
        if FMT == 0:
            amax = _group(tl.abs(x), 0, MODE, DG, K, BR, BA, BC) * clip
            s = _by_const(amax, qf, inv_q, RECIP)
        else:
            lo = tl.minimum(_group(x, 1, MODE, DG, K, BR, BA, BC), 0.0) * clip
            hi = tl.maximum(_group(x, 0, MODE, DG, K, BR, BA, BC), 0.0) * clip
            s = _by_const(hi - lo, qf, inv_q, RECIP)
        s = tl.where(s > 0, s, 1.0)  # integer._store: all-zero groups take 1
        s = tl.minimum(tl.maximum(s, TINY), 65504.0)
        s16 = s.to(tl.float16)
        if FMT == 1:  # rounded up: the next fp16 when the nearest one is below s
            low = (s16.to(tl.float32) < s) & (s16 < 65504.0)
            s16 = tl.where(low, (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), s16)
        sf = s16.to(tl.float32)
        q = _rint(tl.div_rn(x, sf))
        if FMT == 0:
            code = tl.minimum(tl.maximum(q, -qf), qf) + (1 << (BITS - 1))
        else:
            zp = tl.minimum(tl.maximum(_rint(tl.div_rn(-lo, sf)), 0.0), qf)
            code = tl.minimum(tl.maximum(q + zp, 0.0), qf)
        code = code.to(tl.int32)
    elif FMT == 2:  # lm: rms scale, nearest level by counting boundaries (codebook.assign)
        ss = _group(x * x, 2, MODE, DG, K, BR, BA, BC)
        rms = tl.sqrt_rn(_by_const(ss, n_el, inv_n, RECIP)) * clip
        s16 = tl.where(rms > 0, rms, 1.0).to(tl.float16)
        xn = tl.div_rn(x, s16.to(tl.float32))
        code = tl.zeros(x.shape, tl.int32)
        for i in tl.static_range(N_MID):
            code += (xn > tl.load(MID + i)).to(tl.int32)
    else:  # fp8: scale max|x| / fmax, the byte of the clamped x / s
        amax = _group(tl.abs(x), 0, MODE, DG, K, BR, BA, BC) * clip
        s16 = tl.where(amax > 0, _by_const(amax, qf, inv_q, RECIP), 1.0).to(tl.float16)
        y = tl.div_rn(x, s16.to(tl.float32))
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -qf), qf))  # torch's clamp keeps NaN (0 / 0)
        code = _fp8_bits(y, FMT == 4)

    # ---- one scale / zero point per group, written by its first element
    rep = ok & (ch % DG == 0)
    if TG > 1:
        rep = rep & (r == 0)
    sptr = bh * n_srows * NG + (t // TG) * NG + ch // DG
    tl.store(SCALE + sptr, tl.broadcast_to(s16, x.shape), mask=rep)
    if FMT == 1:
        tl.store(ZP + sptr, tl.broadcast_to(zp, x.shape).to(tl.uint8), mask=rep)

    # ---- packed code bytes (2-D indices made afresh: [BR, 1] rows, [1, BA] octets / [1, BC] bytes)
    code = tl.where(ok, code, 0)
    r2 = tl.arange(0, BR)[:, None]
    if TG > 1:
        t2 = blk * TG + r2
        ok2 = r2 < TG
    else:
        t2 = blk * BR + r2
        ok2 = t2 < T
    row = CODES + (bh * T + t2) * RB
    if STREAM:  # the 8 codes of octet a as one little-endian word of 8·BITS bits
        word = tl.sum(code.to(tl.int64) << (c * BITS).to(tl.int64), 2)  # [BR, BA]
        a2 = tile * BA + tl.arange(0, BA)[None, :]
        for j in tl.static_range(BITS):
            byte = (word >> (8 * j)) & 0xFF
            tl.store(row + a2 * BITS + j, byte.to(tl.uint8), mask=ok2 & (a2 * BITS + j < RB))
    else:  # split: slot a of byte c at bits BITS·a
        byte = tl.sum(code << (a * BITS), 1)  # [BR, BC]
        c2 = tile * BC + tl.arange(0, BC)[None, :]
        tl.store(row + c2, byte.to(tl.uint8), mask=ok2 & (c2 < RB))


_MIDPOINTS: dict = {}


def _midpoints(lay, device) -> torch.Tensor:
    """The decision boundaries of ``lay.levels`` (``codebook.assign``'s), float32 on ``device``."""
    key = (lay.levels, torch.device(device))
    m = _MIDPOINTS.get(key)
    if m is None:
        m = _MIDPOINTS[key] = midpoints_below(lay.lut()).to(device)
    return m


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _plan(lay, fmt: str):
    """How the kernel tiles ``lay``: (stream packing?, group reduction MODE, K, BA, BC), the
    tile ``[rows, BA, BC]`` holding one whole row (see the module doc); or NotImplementedError."""
    D, bits, tg, dg = lay.head_dim, lay.bits, lay.token_group, lay.channel_group
    stream = lay.packing == "stream" and bits != 8
    if stream:  # [octets, 8]
        S, BA, BC = 8, _pow2(-(-D // 8)), 8
    else:  # [slots, bytes]
        p = 8 // bits
        S, BA, BC = D // p, p, _pow2(D // p)
    if tg > 1:
        if dg != 1:
            raise NotImplementedError(f"the Triton KV store kernel does not take layout {lay!r} "
                                      f"({fmt}): token groups of {tg} with channel groups of {dg}; "
                                      "allowed: channel group 1 with token groups > 1")
        mode, k = _PER_CHANNEL, 1
    elif dg == D:
        mode, k = _ROW, 1
    elif dg == 1:
        mode, k = _ELEMENT, 1
    elif S % dg == 0 and _is_pow2(dg):
        mode, k = _ALONG_C, 1
    elif dg % S == 0 and _is_pow2(dg // S):
        mode, k = _SPAN_A, dg // S
    else:
        raise NotImplementedError(f"the Triton KV store kernel does not take layout {lay!r} ({fmt}): "
                                  f"channel groups of {dg} over a {lay.packing} packing of {S} channels "
                                  "a slot; allowed: a channel group that divides it or is a power-of-two "
                                  "multiple of it (any group with a power-of-two head_dim)")
    return stream, mode, k, BA, BC


def encode(x: torch.Tensor, spec: KVTensorConfig, layout=None) -> Encoded:
    """Quantize a chunk ``x [B, H, T, D]`` (fp32/fp16/bf16, T a multiple of the token
    group) into the stored layout with one kernel launch; the same result as
    :func:`lessmem.kvcache.codec.encode` (see the module doc).

    ``layout``: where the codes go (default ``kv_layout(spec, D)``); another layout must
    agree with the format on bits, groups, zero point and levels and may differ only in
    packing (``ValueError`` otherwise). A format outside :data:`SUPPORTED_FORMATS` or a
    layout the kernel cannot tile raises ``NotImplementedError`` (use ``codec.encode``)."""
    return _encode(x, spec, layout)


def _encode(x, spec, layout=None, recip: bool | None = None, tile: int | None = None) -> Encoded:
    """``encode`` with its device choices open (tests): ``recip`` divides by Python numbers
    as torch does on CUDA (default: when x is on CUDA); ``tile``: x elements a program."""
    if triton is None:
        raise ValueError("the Triton KV store kernel needs triton (pip install 'lessmem[gpu]')")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in DTYPES:
        what = (f"a {x.dim()}-D {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}")
        raise ValueError(f"x is {what}; allowed: a 4-D [B, H, T, D] tensor of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}")
    B, H, T, D = x.shape
    if spec.channel_bits:
        raise NotImplementedError("the Triton KV store kernel does not take channel_bits (bits per channel); "
                                  "use codec.encode")
    if spec.quantized and spec.format not in SUPPORTED_FORMATS:
        raise NotImplementedError(f"the Triton KV store kernel does not take format {spec.format!r}; "
                                  f"allowed: {', '.join(SUPPORTED_FORMATS)} (use lessmem.kvcache.codec.encode)")
    own = kv_layout(spec, D)  # ValueError: an unquantized format, or a head_dim the format cannot store
    lay = own if layout is None else layout
    if lay.head_dim != D:
        raise ValueError(f"x has head_dim {D}, layout {lay!r} head_dim {lay.head_dim}; allowed: the same")
    if lay is not own and (lay.bits, lay.token_group, lay.channel_group, lay.has_zero_point,
                           lay.zero_const, lay.levels) != (own.bits, own.token_group, own.channel_group,
                                                           own.has_zero_point, own.zero_const, own.levels):
        raise ValueError(f"layout {lay!r} does not store format {spec.format}{spec.bits} "
                         f"(expected {own!r} up to packing)")
    tg, dg = lay.token_group, lay.channel_group
    if T % tg:
        raise ValueError(f"chunk of {T} tokens; allowed: a multiple of the token group {tg}")
    if lay.packing not in PACKINGS:
        raise NotImplementedError(f"the Triton KV store kernel does not take layout {lay!r}: packing "
                                  f"{lay.packing!r}; allowed: {', '.join(PACKINGS)}")
    stream, mode, k, BA, BC = _plan(lay, spec.format)
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton KV store kernel runs on CUDA tensors (x is on {x.device}), or on "
                         "CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton "
                         "is imported)")

    dev = x.device
    codes = torch.empty(lay.part_shape("codes", B, H, T), dtype=lay.CODES_DTYPE, device=dev)
    qshape = lay.part_shape("scale", B, H, T)
    scale = torch.empty(qshape, dtype=lay.SCALE_DTYPE, device=dev)
    zp = torch.empty(qshape, dtype=lay.ZERO_POINT_DTYPE, device=dev) if lay.has_zero_point else None
    if codes.numel() == 0:
        return Encoded(codes, scale, zp)

    fmt = spec.format
    if fmt in ("int", "uint"):
        q = 2 ** (spec.bits - 1) - 1 if fmt == "int" else 2**spec.bits - 1
    else:
        q = _FMAX.get(fmt, 1.0)
    n_el = tg * dg  # elements of a group (the lm mean)
    mid = _midpoints(lay, dev) if fmt == "lm" else scale  # (a pointer the kernel never reads)
    # streamed octets / split bytes hold independent channels: tile them when the groups allow
    limit = tile or (_TILE if dev.type == "cuda" else _TILE_INTERPRETED)
    recip = dev.type == "cuda" if recip is None else recip
    rows = _pow2(tg) if tg > 1 else min(_pow2(T), max(1, limit // (BA * BC)))
    tiles = 1
    if mode in (_PER_CHANNEL, _ELEMENT):
        while rows * BA * BC // tiles > limit and (BA if stream else BC) // tiles > 1:
            tiles *= 2
    ba, bc = (BA // tiles, BC) if stream else (BA, BC // tiles)
    grid = (T // tg if tg > 1 else -(-T // rows), B * H, tiles)
    warps = 8 if rows * ba * bc >= 4096 else 4
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _encode_kernel[grid](
            x, x.stride(0), x.stride(1), x.stride(2), x.stride(3), codes, scale,
            zp if zp is not None else scale, mid,
            H, T, qshape[2], float(spec.clip_ratio), float(q), float(np.float32(1.0) / np.float32(q)),
            float(n_el), float(np.float32(1.0) / np.float32(n_el)),
            FMT=SUPPORTED_FORMATS[fmt], BITS=lay.bits, STREAM=stream, D=D, TG=tg, DG=dg, MODE=mode, K=k,
            RECIP=recip, TINY=_TINY[lay.SCALE_DTYPE], N_MID=2**lay.bits - 1 if fmt == "lm" else 0,
            BR=rows, BA=ba, BC=bc, num_warps=warps, enable_fp_fusion=False)
    return Encoded(codes, scale, zp)
