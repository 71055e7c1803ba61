"""Attention over a quantized KV history without inflating it (CPU fused kernel + torch fallback).

``quantized_attention(q, kv, mask)`` returns ``(out, lse)`` for query rows ``q [B, Hq, Tq, D]``
(already multiplied by the softmax scaling, and rotated if the keys were) against a
:class:`QuantKV` history of T tokens: ``out = softmax(q·kᵀ + mask)·v`` and
``lse = log Σ_t exp(q·k_t + mask_t)`` per row, so a caller can merge it with attention
over full-precision tokens (sinks, window, current chunk) exactly:

    lse = logaddexp(lse_a, lse_b);  out = out_a·e^(lse_a − lse) + out_b·e^(lse_b − lse)

Each side (keys, values) is stored as packed code rows, fp16 scales and optional uint8
zero points per (tg tokens × dg channels) group, as its
:class:`~lessmem.formats.kvlayout.KVLayout` describes; dequantization is
``x = scale · (lut[c] − z)``.

Paths: the C++ kernel (``csrc/attention.cpp``, loaded by ``attention_cpp.load``, OpenMP over batch × KV head × history
split, flash-style online softmax, codes unpacked inside the dot product); without a
compiler, the torch fallback ``attention_torch.torch_attention`` (chunks of 256 tokens,
the same online softmax). The test oracle, ``attention_reference``, dequantizes
everything with its own bit arithmetic; no production path imports it.

Example:
    >>> import torch
    >>> from lessmem.formats.kvlayout import KVLayout
    >>> from lessmem.kernels.attention import QuantSide, QuantKV, quantized_attention
    >>> from lessmem.kernels.attention_reference import attention_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> lay = KVLayout(bits=4, head_dim=64, channel_group=64, zero_const=8.0)
    >>> side = lambda: QuantSide(torch.randint(0, 256, (1, 2, 40, 32), dtype=torch.uint8, generator=g),
    ...                          torch.rand(1, 2, 40, 1, generator=g).half(), None, lay)
    >>> kv = QuantKV(side(), side())
    >>> q = torch.randn(1, 4, 3, 64, generator=g) * 0.1
    >>> o, lse = quantized_attention(q, kv)
    >>> o_ref, lse_ref = attention_reference(q, kv)
    >>> bool(torch.allclose(o, o_ref, atol=1e-4)), bool(torch.allclose(lse, lse_ref, atol=1e-4))
    (True, True)
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass

import torch

from ..formats.kvlayout import KVLayout
from . import attention_cpp, ops
from .attention_cpp import PACKING_IDS
from .attention_torch import torch_attention


@dataclass(frozen=True)
class QuantSide:
    """One side (keys or values) of a quantized history: packed ``codes``
    [B, H, T, row_bytes] uint8, ``scale`` fp16 [B, H, ceil(T/tg), D/dg], ``zero_point``
    uint8 of the scale's shape (only when the layout stores zero points), all laid out as
    ``layout`` (a :class:`~lessmem.formats.kvlayout.KVLayout`) says."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    layout: KVLayout

    def __post_init__(self):
        if not isinstance(self.layout, KVLayout):
            raise TypeError(f"layout={self.layout!r}; allowed: a lessmem.formats.kvlayout.KVLayout")
        if (self.zero_point is not None) != self.layout.has_zero_point:
            raise ValueError(f"zero_point {'given' if self.zero_point is not None else 'missing'}; the "
                             f"layout {'stores' if self.layout.has_zero_point else 'has no'} zero points")

    # the layout's numbers under the names the kernels use
    @property
    def bits(self) -> int:
        return self.layout.bits

    @property
    def tg(self) -> int:
        return self.layout.token_group

    @property
    def n_tokens(self) -> int:
        return self.codes.shape[2]

    def slice_tokens(self, t0: int, t1: int) -> QuantSide:
        """The rows of tokens [t0, t1) (t0, t1 multiples of tg)."""
        s0, s1 = t0 // self.tg, -(-t1 // self.tg)
        zp = self.zero_point[:, :, s0:s1] if self.zero_point is not None else None
        return QuantSide(self.codes[:, :, t0:t1], self.scale[:, :, s0:s1], zp, self.layout)

    def dequantize(self) -> torch.Tensor:
        """float32 [B, H, T, D] (the torch path; the test oracle is in ``attention_reference``)."""
        return self.layout.dequantize(self.codes, self.scale, self.zero_point)

    def to_float(self) -> torch.Tensor:
        """float32 [B, H, T, D] as the fused kernels decode it: on the CPU, the C++ decoder
        (``qdequant``; its output is its one allocation, where :meth:`dequantize` makes int64
        codes and a few more temporaries the output's size), else :meth:`dequantize`. The
        two agree to the last bit or so (``s·c − s·z`` against ``s·(c − z)``)."""
        mod = _module() if self.codes.device.type == "cpu" else None
        if mod is None:
            return self.dequantize()
        return mod.qdequant(*_side_args(self, [(self.codes, self.scale, self.zero_point)]), self.layout.head_dim)


@dataclass(frozen=True)
class QuantKV:
    """The quantized history of one layer: keys and values sides of T tokens each."""

    keys: QuantSide
    values: QuantSide

    @property
    def n_tokens(self) -> int:
        return self.keys.n_tokens

    @property
    def n_kv_heads(self) -> int:
        return self.keys.codes.shape[1]


def _cat_parts(t: QuantSide, parts) -> QuantSide:
    zp = torch.cat([p[2] for p in parts], 2) if t.zero_point is not None else None
    return QuantSide(torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2), zp,
                     t.layout)


@dataclass(frozen=True)
class SegmentedKV:
    """A history that arrives in pieces (blocks fetched from different tiers) and is read
    in place, never concatenated. ``k_parts[i]``/``v_parts[i]`` = ``(codes, scale,
    zero_point or None)`` of tokens ``[i·seg, i·seg + n_i)``, laid out like a
    :class:`QuantSide`'s tensors; every part but the last has ``seg`` tokens, a multiple of
    both sides' token groups. ``k``/``v`` give the formats (bits, groups, level table,
    zero constant); their own tensors are not read. The C++ kernel walks the parts
    directly; ``keys``/``values`` join them (a copy) for the reference and torch paths."""

    k: QuantSide
    v: QuantSide
    k_parts: tuple
    v_parts: tuple
    seg: int

    def __post_init__(self):
        sizes = [p[0].shape[2] for p in self.k_parts]
        tg = max(self.k.tg, self.v.tg)
        if not sizes or [p[0].shape[2] for p in self.v_parts] != sizes or self.seg <= 0 or self.seg % tg \
                or any(n != self.seg for n in sizes[:-1]) or not 0 < sizes[-1] <= self.seg:
            raise ValueError(f"SegmentedKV parts of {sizes} tokens, seg={self.seg}; allowed: every part "
                             f"but the last of seg tokens, a multiple of {tg}, keys and values alike")
        object.__setattr__(self, "n_tokens", sum(sizes))

    @property
    def n_kv_heads(self) -> int:
        return self.k_parts[0][0].shape[1]

    @functools.cached_property
    def joined(self) -> QuantKV:
        return QuantKV(_cat_parts(self.k, self.k_parts), _cat_parts(self.v, self.v_parts))

    @property
    def keys(self) -> QuantSide:
        return self.joined.keys

    @property
    def values(self) -> QuantSide:
        return self.joined.values


_LOADED: list = []  # attention_cpp.load()'s answer, once asked with the C++ kernel allowed


def _module():
    """The compiled kernel module, or None (``LESSMEM_NO_CPP=1``, read on every call; no
    compiler). Every decode row asks, 30 times a step: the build's own cache lookup cost
    ~7 µs of a layer there, the memo here one list read."""
    if os.environ.get("LESSMEM_NO_CPP") == "1":
        return None
    if not _LOADED:
        _LOADED.append(attention_cpp.load())
    return _LOADED[0]


def cpp_available() -> bool:
    """True when the compiled C++ kernel is usable (builds it on first call)."""
    return _module() is not None


def _n_split(B: int, H: int, T: int) -> int:
    """Splits of each (batch, KV head)'s history: about 4 work items per thread, their
    count rounded up to a multiple of the threads (3 KV heads on 2 threads: 4 splits, not 3,
    which left one thread idle for a fifth of the call), none shorter than 128 tokens."""
    threads = torch.get_num_threads()
    bh = B * H
    step = threads // math.gcd(bh, threads)  # bh · splits is a multiple of threads iff splits is one of step
    want = -(-max(1, -(-4 * threads // bh)) // step) * step
    return max(1, min(want, T // 128 or 1))


def _side_args(t: QuantSide, parts):
    """The kernel's arguments for one side: format ``t`` and ``(codes, scale, zp)`` parts."""
    empty_f = torch.empty(0, dtype=torch.float32)  # contiguity and fp16 scales: made in C++
    lay = t.layout
    lut = lay.lut("cpu")
    return ([p[0] for p in parts], [p[1] for p in parts],
            [p[2] for p in parts] if lay.has_zero_point else [],
            lut if lut is not None else empty_f,
            PACKING_IDS[lay.packing], lay.kernel_bits, lay.token_group, lay.channel_group, lay.zero_const)


def _kernel_history(kv):
    """(key args, value args, seg) of a QuantKV or SegmentedKV for ``qattn_forward``."""
    if isinstance(kv, SegmentedKV):
        return (*_side_args(kv.k, kv.k_parts), *_side_args(kv.v, kv.v_parts), int(kv.seg))
    k, v = kv.keys, kv.values
    return (*_side_args(k, [(k.codes, k.scale, k.zero_point)]),
            *_side_args(v, [(v.codes, v.scale, v.zero_point)]), 0)


def quantized_attention(q: torch.Tensor, kv: QuantKV, mask: torch.Tensor | None = None,
                        use_cpp: bool | None = None):
    """(out float32 [B, Hq, Tq, D], lse float32 [B, Hq, Tq]); ``mask``: additive float
    [B, Tq, T] (or None). ``use_cpp=None`` picks the C++ kernel on CPU when it builds."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, Tq, D], got shape {tuple(q.shape)}")
    B, Hq, Tq, D = q.shape
    Hkv = kv.n_kv_heads
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of the KV heads {Hkv}")
    T = kv.n_tokens
    if T == 0:
        return (torch.zeros(B, Hq, Tq, D, device=q.device),
                torch.full((B, Hq, Tq), float("-inf"), device=q.device))
    if mask is not None:
        mask = mask.float().contiguous()
        if tuple(mask.shape) != (B, Tq, T):
            raise ValueError(f"mask must be [B, Tq, T] = {(B, Tq, T)}, got {tuple(mask.shape)}")
    if (q.device.type != "cpu" and use_cpp is None) or torch.compiler.is_compiling():
        # the torch op: its device's backend (CUDA: Triton), traceable by torch.compile. CPU in
        # eager mode runs the CPU backend's code below directly: the dispatcher costs ~9 us a
        # call (0.3 ms a token over 30 layers), and the CPU decode must not get slower
        return ops.quantized_attention_op(q, kv, mask)
    return _cpu_attention(q, kv, mask, use_cpp)


def _cpu_attention(q, kv, mask, use_cpp):
    """The CPU backend: the C++ kernel, or the torch fallback (``mask`` checked, float32)."""
    B, Hkv, T = q.shape[0], kv.n_kv_heads, kv.n_tokens
    if use_cpp is None:
        use_cpp = q.device.type == "cpu" and os.environ.get("LESSMEM_NO_CPP") != "1"
    mod = _module() if use_cpp and q.device.type == "cpu" else None
    if mod is None:
        return torch_attention(q, kv, mask)
    m = mask if mask is not None else torch.empty(0, dtype=torch.float32)
    e = torch.empty(0, dtype=torch.float32)
    out, _, lse = mod.qattn_forward(q.float().contiguous(), *_kernel_args(kv), m, _n_split(B, Hkv, T),
                                    e, e, e, e, False)
    return out, lse


def _history_of(k_codes, k_scale, k_zero_point, k_layout, v_codes, v_scale, v_zero_point, v_layout, seg):
    """The QuantKV / SegmentedKV behind the op's arguments (the parts are not copied)."""
    kl, vl = ops.layout_of(k_layout), ops.layout_of(v_layout)
    kp, vp = ops.parts(k_codes, k_scale, k_zero_point), ops.parts(v_codes, v_scale, v_zero_point)
    if len(kp) == 1 and len(vp) == 1 and not seg:
        return QuantKV(QuantSide(*kp[0], kl), QuantSide(*vp[0], vl))
    return SegmentedKV(QuantSide(*kp[0], kl), QuantSide(*vp[0], vl), tuple(kp), tuple(vp), seg)


def _check_op(q, kv, mask):
    if q.dim() != 4 or q.shape[1] % kv.n_kv_heads:
        raise ValueError(f"q of shape {tuple(q.shape)}; allowed: [B, Hq, Tq, D] with Hq a multiple of the "
                         f"KV heads {kv.n_kv_heads}")
    want = (q.shape[0], q.shape[2], kv.n_tokens)
    if mask is not None and tuple(mask.shape) != want:
        raise ValueError(f"mask must be [B, Tq, T] = {want}, got {tuple(mask.shape)}")
    return mask.float().contiguous() if mask is not None else None


def _cpu_backend(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point, v_lut,
                 v_layout, mask, seg):
    kv = _history_of(k_codes, k_scale, k_zero_point, k_layout, v_codes, v_scale, v_zero_point, v_layout, seg)
    return _cpu_attention(q, kv, _check_op(q, kv, mask), None)


_warned_devices: set = set()


def _fallback_backend(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point,
                      v_lut, v_layout, mask, seg):
    """Devices without a backend of their own (and CUDA without triton): the torch fallback."""
    if q.device.type not in _warned_devices:
        _warned_devices.add(q.device.type)
        hint = " (pip install 'lessmem[gpu]' for the Triton kernel)" if q.device.type == "cuda" else ""
        warnings.warn(f"lessmem: no quantized-attention kernel for {q.device.type} tensors{hint}; using the "
                      "torch fallback (kernels.attention_torch, the slow path)", RuntimeWarning, stacklevel=2)
    kv = _history_of(k_codes, k_scale, k_zero_point, k_layout, v_codes, v_scale, v_zero_point, v_layout, seg)
    return torch_attention(q, kv, _check_op(q, kv, mask))


ops.LIB.impl("quantized_attention", _cpu_backend, "CPU")
ops.LIB.impl("quantized_attention", _fallback_backend, "CompositeExplicitAutograd")


def _cuda_backend(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point, v_lut,
                  v_layout, mask, seg):
    """CUDA: the Triton kernel; a ``mixed`` layout (bits per key channel), which it does not
    read, goes to the torch fallback on the device."""
    if "mixed" in (ops.layout_of(k_layout).packing, ops.layout_of(v_layout).packing):
        kv = _history_of(k_codes, k_scale, k_zero_point, k_layout, v_codes, v_scale, v_zero_point, v_layout, seg)
        return torch_attention(q, kv, _check_op(q, kv, mask))
    return ops._triton_backend(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point,
                               v_lut, v_layout, mask, seg)


if importlib.util.find_spec("triton") is not None:  # CUDA without triton: the fallback, with a warning
    ops.LIB.impl("quantized_attention", _cuda_backend, "CUDA")


def fused_attention(q_h: torch.Tensor, kv: QuantKV, mask_h: torch.Tensor | None, q_f: torch.Tensor,
                    k_f: torch.Tensor, v_f: torch.Tensor, mask_f: torch.Tensor | None, causal: bool):
    """One C++ call for a decode step: quantized history *and* full-precision tokens.

    ``q_h`` scores the history (scaled, rotated like the keys), ``q_f`` the fp tokens
    ``k_f, v_f`` [B, Hkv, Lf, D] (scaled, unrotated); masks are additive [B, Tq, ·];
    ``causal``: fp token j is visible to row tq only when j <= Lf − Tq + tq. Returns
    ``(out_h, out_f, lse)``, both outputs divided by the joint softmax sum, so the
    attention output is ``out_f + out_h`` (after un-rotating ``out_h`` if values were
    rotated). Returns None when the C++ kernel is unavailable (the caller falls back).
    """
    mod = _module() if q_h.device.type == "cpu" else None
    if mod is None:
        return None
    B, Hq, Tq, D = q_h.shape
    Hkv, T = kv.n_kv_heads, kv.n_tokens
    e = torch.empty(0, dtype=torch.float32)
    mh = mask_h.float().contiguous() if mask_h is not None else e
    mf = mask_f.float().contiguous() if mask_f is not None else e
    return mod.qattn_forward(q_h.float().contiguous(), *_kernel_args(kv), mh, _n_split(B, Hkv, T), q_f.float().contiguous(), k_f.float().contiguous(),
                             v_f.float().contiguous(), mf, bool(causal))


def _kernel_args(kv) -> tuple:
    """:func:`_kernel_history` of ``kv``, made once per history object (a layer hands out
    the same object until its history grows: a serving step asks for it in every layer)."""
    got = kv.__dict__.get("_lessmem_kernel_args")
    if got is None:
        got = kv.__dict__["_lessmem_kernel_args"] = _kernel_history(kv)  # (frozen: not through setattr)
    return got


def _kernel_table(kv) -> torch.Tensor:
    """The pointer table ``qattn_batch`` reads ``kv``'s parts through (``side_from_table``
    in ``csrc/attention.cpp``): per side ``[segments, row bytes, has zero points]`` then
    ``[tokens, scale rows, codes, scale, zero point]`` addresses per segment. Made once
    per history object, which keeps the (uint8 / fp16, contiguous) tensors it points into."""
    got = kv.__dict__.get("_lessmem_kernel_table")
    if got is None:
        args, keep, rows = _kernel_args(kv), [], []
        for codes, scales, zps in ((args[0], args[1], args[2]), (args[9], args[10], args[11])):
            rows += [len(codes), int(codes[0].shape[3]), int(bool(zps))]
            for i, (c, s) in enumerate(zip(codes, scales, strict=True)):
                seg, held = _segment_rows(c, s, zps[i] if zps else None)
                rows += seg
                keep += held
        got = kv.__dict__["_lessmem_kernel_table"] = (torch.tensor(rows, dtype=torch.int64), keep)
    return got[0]


def _segment_rows(c: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> tuple[list, list]:
    """One segment's entries of the pointer table (``[tokens, scale rows, codes, scale, zero
    point]`` addresses) and the copies they point into (none where the parts are stored as
    the kernel reads them: uint8 codes, float16 scales, contiguous). Such parts' entries are
    remembered on the codes tensor (they are its own shape and addresses): a serving
    request's pages never change, and each new page (a block every 64 tokens) had made its
    layer's table again from all of them (~0.25 ms at 17 pages, a dozen times a 12-row
    decode step)."""
    memo = c.__dict__.get("_lessmem_segment")
    if memo is not None and memo[0] is s and memo[1] is z:
        return memo[2], []
    c2, s2 = c.to(torch.uint8).contiguous(), s.to(torch.float16).contiguous()
    z2 = None if z is None else z.to(torch.uint8).contiguous()
    rows = [int(c2.shape[2]), int(s2.shape[2]), c2.data_ptr(), s2.data_ptr(), 0 if z2 is None else z2.data_ptr()]
    held = [t for t, orig in ((c2, c), (s2, s), (z2, z)) if t is not orig]
    if not held:  # (a copy's entries are not kept: its source could be written again in place)
        c.__dict__["_lessmem_segment"] = (s, z, rows)
    return rows, held


def _layouts(kv) -> tuple:
    """(key layout, value layout) of a QuantKV or SegmentedKV."""
    if isinstance(kv, SegmentedKV):
        return kv.k.layout, kv.v.layout
    return kv.keys.layout, kv.values.layout


def _fp_piece(t: torch.Tensor) -> torch.Tensor:
    """A full-precision piece [1, Hkv, L, D] as the batch kernel reads it: float32 or float16,
    rows of D contiguous and in order within a head, heads any number of rows apart (a
    window is a prefix of a buffer with room to grow: read in place)."""
    if t.dtype not in (torch.float32, torch.float16):
        t = t.float()
    _, H, L, D = t.shape
    rows_ok = t.stride(3) == 1 and (L < 2 or t.stride(2) == D)
    return t if rows_ok and (H < 2 or t.stride(1) >= L * D) else t.contiguous()


def _fp_pair(k: torch.Tensor, v: torch.Tensor):
    """Keys and values of one piece as :func:`_fp_piece` makes them, their heads equally far
    apart (the kernel reads both with one head stride)."""
    k, v = _fp_piece(k), _fp_piece(v)
    if k.shape[1] > 1 and k.stride(1) != v.stride(1):
        k, v = k.contiguous(), v.contiguous()
    return k, v


def fused_attention_rows(q: torch.Tensor, scaling: float, rk: torch.Tensor | None, rv: torch.Tensor | None,
                         histories: list, fp_pieces: list):
    """Decode rows in one C++ call with everything around the attention inside it
    (``qattn_rows``): ``q`` [R, Hq, D] as the model made it (unscaled, unrotated; any float
    dtype), row r against ``histories[r]`` (one format for all) and its full-precision pieces
    ``fp_pieces[r]`` (a list of ``(k, v)`` [1, Hkv, L, D], read in place where the kernel
    can). ``rk``: Rᵀ of the keys' rotation (``x @ rk`` rotates), ``rv``: R of the values'
    (``y @ rv`` undoes it), None for none. Returns the attention output [R, Hq, D] float32
    (each row the same whatever else is in the call), or None without the C++ kernel.

    A history's part of the arguments is made once per history object and thread count (a
    decode step makes this call in every layer; assembling them had cost as long as the
    attention)."""
    mod = _module() if q.device.type == "cpu" else None
    if mod is None or not histories:
        return None
    nt = torch.get_num_threads()
    kl = vl = None
    tables, seg, splits = [], [], []
    for r, kv in enumerate(histories):
        got = kv.__dict__.get("_lessmem_row_args")
        if got is None or got[0] != nt:
            first = _kernel_args(kv)
            got = kv.__dict__["_lessmem_row_args"] = (
                nt, _kernel_table(kv), (*first[3:9], *first[12:18]), first[18],
                _n_split(1, kv.n_kv_heads, kv.n_tokens), _layouts(kv))
        if r == 0:
            kl, vl, fmt = got[5][0], got[5][1], got[2]
        elif got[5] != (kl, vl):
            raise ValueError(f"history {r} is stored in another format than history 0 "
                             f"({got[5][0].bits}/{got[5][1].bits} bits, {kl.bits}/{vl.bits} there); "
                             "allowed: one format for all")
        tables.append(got[1])
        seg.append(got[3])
        splits.append(got[4])
    e = _EMPTY
    return mod.qattn_rows(q, float(scaling), e if rk is None else rk, e if rv is None else rv, tables,
                          histories[0].n_kv_heads, *fmt, seg, [[p[0] for p in ps] for ps in fp_pieces],
                          [[p[1] for p in ps] for ps in fp_pieces], splits)


_EMPTY = torch.empty(0, dtype=torch.float32)


def fused_attention_batch(q_h: torch.Tensor, q_f: torch.Tensor, histories: list, fp_pieces: list):
    """Decode rows of many requests in one C++ call (a serving step, ``serve.batch``).

    Request r has one query row per head, ``q_h[r]`` [Hq, D] for its quantized history
    ``histories[r]`` (a QuantKV or SegmentedKV; all of one format) and ``q_f[r]`` for its
    full-precision pieces ``fp_pieces[r]``, a list of ``(k, v)`` [1, Hkv, L, D] (sinks,
    window, current token, each read in place, float32 or float16). Both ``q`` scaled, ``q_h`` rotated like
    the keys. Returns ``(out_h, out_f)`` float32 [R, Hq, D] as :func:`fused_attention`
    does, or None without the C++ kernel. Each request's result equals what it gets in a
    batch of one (its splits depend on its own history only).
    """
    mod = _module() if q_h.device.type == "cpu" else None
    if mod is None or not histories:
        return None
    kl, vl = _layouts(histories[0])
    tables, seg, fk, fv, splits = [], [], [], [], []
    for r, (kv, pieces) in enumerate(zip(histories, fp_pieces, strict=True)):
        if _layouts(kv) != (kl, vl):
            raise ValueError(f"history {r} is stored in another format than history 0 "
                             f"({_layouts(kv)[0].bits}/{_layouts(kv)[1].bits} bits, {kl.bits}/{vl.bits} there); "
                             "allowed: one format for all")
        tables.append(_kernel_table(kv))
        seg.append(_kernel_args(kv)[18])
        pairs = [_fp_pair(*p) for p in pieces]
        fk.append([p[0] for p in pairs])
        fv.append([p[1] for p in pairs])
        splits.append(_n_split(1, kv.n_kv_heads, kv.n_tokens))  # its own numbers: batch-independent
    first = _kernel_args(histories[0])
    return mod.qattn_batch(q_h.float().contiguous(), q_f.float().contiguous(), tables, histories[0].n_kv_heads,
                           *first[3:9], *first[12:18], seg, fk, fv, splits)
