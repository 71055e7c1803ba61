"""Triton decode attention over a quantized KV history: split-K flash-decoding.

``triton_attention(q, kv, mask)`` returns the same ``(out float32 [B, Hq, Tq, D], lse
float32 [B, Hq, Tq])`` as :func:`~lessmem.kernels.attention.quantized_attention` for a
:class:`~lessmem.kernels.attention.QuantKV` or a
:class:`~lessmem.kernels.attention.SegmentedKV` history (``q`` already scaled, and
rotated by the caller if the keys were: the kernel never sees the rotation).

Two kernels, after flash-decoding (Dao et al., "Flash-Decoding for long-context
inference", 2023; the split-K scheme of FlashAttention-2, Dao 2023):

1. ``_partial``: one program per (batch b, KV head h, split s of the tokens). It loads
   the ``n_rep · Tq`` query rows of the query heads that share KV head h once, then walks
   its tokens in tiles of ``BLOCK_T``: each tile's code bytes are unpacked with explicit
   shifts and masks (no integer ``tl.dot``), dequantized ``k = scale · (lut[c] − z)`` with
   the scale / zero point of each (token group × channel group), scored with one fp32
   ``tl.dot`` against the query rows and folded into an online softmax (running max m,
   sum l, accumulator rescaled by ``exp(m_old − m_new)``); the value rows are decoded the
   same way and accumulated with ``p · v``. It writes its unnormalized ``(m, l, acc)``.
2. ``_combine``: one program per (b, h) merges the splits by log-sum-exp:
   ``out = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M)``, ``lse = M + log Σ_s l_s·e^(m_s − M)``.

A :class:`SegmentedKV` (blocks from different tiers) is read in place: one ``_partial``
launch per part, all writing their splits into one partials buffer, and one
``_combine`` for the lot; nothing the size of the history is ever copied.

Layouts: every :class:`~lessmem.formats.kvlayout.KVLayout` the cache writes (the packing
is a compile-time constant, so each layout gets its own specialized kernel): ``split``
packing at 1/2/4/8 bits (byte j holds channels j, j + D/p, …), ``stream`` packing at any
width (little-endian bit stream: a code may straddle two bytes), uint8 zero points or a
constant zero, and level tables (fp8 and Lloyd-Max codebooks: ``lut[c]`` is a gather from
a 2^bits table). A packing the kernel does not know is refused with its name.

On CUDA tensors the kernels are compiled by Triton. With ``TRITON_INTERPRET=1`` set
before triton is imported (the mode is then fixed for the process: triton's own library
functions are built for it at import), they run on CPU tensors under Triton's
interpreter: ``tests/kernels/test_triton_attention.py`` checks them against
``attention_reference`` that way, in a subprocess, on machines without a GPU.

Example:
    >>> import torch  # doctest: +SKIP
    >>> from lessmem.kernels.attention_triton import triton_attention  # doctest: +SKIP
    >>> out, lse = triton_attention(q.cuda(), kv_on_cuda)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from ._triton import available, interpreting, tl, triton  # noqa: F401  (available: public)
from ._triton import jit as _jit

PACKINGS = {"split": 0, "stream": 1}  # KVLayout.packing -> the kernel's PACK constant
BLOCK_T = 32  # history tokens per tile


def check_layout(layout) -> None:
    """Raise ValueError naming ``layout`` when the kernel cannot read it."""
    if layout.packing not in PACKINGS:
        raise ValueError(f"the Triton attention kernel cannot read layout {layout!r}: packing "
                         f"{layout.packing!r}; allowed: {', '.join(PACKINGS)}")
    if not 1 <= layout.bits <= 8:
        raise ValueError(f"the Triton attention kernel cannot read layout {layout!r}: bits "
                         f"{layout.bits}; allowed: 1 to 8")


@_jit
def _partial(Q, sq_b, sq_h, sq_t,
                KC, skc_b, skc_h, skc_t, KS, sks_b, sks_h, sks_t, KZ, skz_b, skz_h, skz_t, KL, k_zc,
                VC, svc_b, svc_h, svc_t, VS, svs_b, svs_h, svs_t, VZ, svz_b, svz_h, svz_t, VL, v_zc,
                MASK, sm_b, sm_t, mask_off,
                PM, PL, PACC,
                Hkv, Tq, M, D, T, per_split, split_off, n_split_total,
                K_BITS: tl.constexpr, K_PACK: tl.constexpr, K_TG: tl.constexpr, K_DG: tl.constexpr,
                K_ZP: tl.constexpr, K_LUT: tl.constexpr,
                V_BITS: tl.constexpr, V_PACK: tl.constexpr, V_TG: tl.constexpr, V_DG: tl.constexpr,
                V_ZP: tl.constexpr, V_LUT: tl.constexpr,
                HAS_MASK: tl.constexpr, REP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    t_lo = sp * per_split
    t_hi = tl.minimum(t_lo + per_split, T)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    row_ok = offs_m < M
    d_ok = offs_d < D
    hq = h * REP + offs_m // Tq  # query head of each row (GQA: REP heads share KV head h)
    tq = offs_m % Tq
    q = tl.load(Q + b * sq_b + hq[:, None] * sq_h + tq[:, None] * sq_t + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # where channel d's code sits in a packed row: byte, shift (and a second byte when a
    # stream code straddles two); the row's byte count is D·bits/8
    k_rb = D * K_BITS // 8
    if K_BITS == 8:
        k_byte = offs_d
        k_sh = offs_d * 0
    elif K_PACK == 0:  # split: byte j holds channels j + i·(D/p), slot i at bits·i
        k_byte = offs_d % k_rb
        k_sh = (offs_d // k_rb) * K_BITS
    else:  # stream: little-endian bit stream
        k_byte = (offs_d * K_BITS) // 8
        k_sh = (offs_d * K_BITS) % 8
    v_rb = D * V_BITS // 8
    if V_BITS == 8:
        v_byte = offs_d
        v_sh = offs_d * 0
    elif V_PACK == 0:
        v_byte = offs_d % v_rb
        v_sh = (offs_d // v_rb) * V_BITS
    else:
        v_byte = (offs_d * V_BITS) // 8
        v_sh = (offs_d * V_BITS) % 8

    kc_base = KC + b * skc_b + h * skc_h
    ks_base = KS + b * sks_b + h * sks_h
    kz_base = KZ + b * skz_b + h * skz_h
    vc_base = VC + b * svc_b + h * svc_h
    vs_base = VS + b * svs_b + h * svs_h
    vz_base = VZ + b * svz_b + h * svz_h

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + offs_t
        t_ok = t < t_hi
        ld = t_ok[:, None] & d_ok[None, :]

        # ---- keys: [BLOCK_T, BLOCK_D] floats from the packed rows
        w = tl.load(kc_base + t[:, None] * skc_t + k_byte[None, :], mask=ld, other=0).to(tl.int32)
        if K_PACK == 1 and 8 % K_BITS != 0:
            hi = tl.load(kc_base + t[:, None] * skc_t + k_byte[None, :] + 1,
                         mask=ld & (k_byte[None, :] + 1 < k_rb), other=0).to(tl.int32)
            w = w | (hi << 8)
        c = (w >> k_sh[None, :]) & ((1 << K_BITS) - 1)
        if K_LUT:
            x = tl.load(KL + c, mask=ld, other=0.0)
        else:
            x = c.to(tl.float32)
        g = (t // K_TG)[:, None]
        gd = (offs_d // K_DG)[None, :]
        s = tl.load(ks_base + g * sks_t + gd, mask=ld, other=0.0).to(tl.float32)
        if K_ZP:
            z = tl.load(kz_base + g * skz_t + gd, mask=ld, other=0).to(tl.float32)
            k = s * (x - z)
        else:
            k = s * (x - k_zc)

        # ---- scores of the REP·Tq query rows against the tile
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        if HAS_MASK:
            sc += tl.load(MASK + b * sm_b + tq[:, None] * sm_t + (mask_off + t)[None, :],
                          mask=row_ok[:, None] & t_ok[None, :], other=0.0)
        sc = tl.where(t_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        # ---- values, the same decoding
        w = tl.load(vc_base + t[:, None] * svc_t + v_byte[None, :], mask=ld, other=0).to(tl.int32)
        if V_PACK == 1 and 8 % V_BITS != 0:
            hi = tl.load(vc_base + t[:, None] * svc_t + v_byte[None, :] + 1,
                         mask=ld & (v_byte[None, :] + 1 < v_rb), other=0).to(tl.int32)
            w = w | (hi << 8)
        c = (w >> v_sh[None, :]) & ((1 << V_BITS) - 1)
        if V_LUT:
            x = tl.load(VL + c, mask=ld, other=0.0)
        else:
            x = c.to(tl.float32)
        g = (t // V_TG)[:, None]
        gd = (offs_d // V_DG)[None, :]
        s = tl.load(vs_base + g * svs_t + gd, mask=ld, other=0.0).to(tl.float32)
        if V_ZP:
            z = tl.load(vz_base + g * svz_t + gd, mask=ld, other=0).to(tl.float32)
            v = s * (x - z)
        else:
            v = s * (x - v_zc)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    slot = bh * n_split_total + split_off + sp
    tl.store(PM + slot * BLOCK_M + offs_m, m_i)
    tl.store(PL + slot * BLOCK_M + offs_m, l_i)
    tl.store(PACC + (slot * BLOCK_M + offs_m[:, None]) * BLOCK_D + offs_d[None, :], acc)


@_jit
def _combine(PM, PL, PACC, OUT, LSE, Hkv, Hq, Tq, M, D, n_split,
                REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // Hkv
    h = bh % Hkv
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = bh * n_split
    g_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for sp in range(0, n_split):  # the largest running max over the splits
        g_m = tl.maximum(g_m, tl.load(PM + (base + sp) * BLOCK_M + offs_m))
    g_safe = tl.where(g_m == float("-inf"), 0.0, g_m)
    l_tot = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for sp in range(0, n_split):
        w = tl.exp(tl.load(PM + (base + sp) * BLOCK_M + offs_m) - g_safe)
        l_tot += w * tl.load(PL + (base + sp) * BLOCK_M + offs_m)
        acc += w[:, None] * tl.load(PACC + ((base + sp) * BLOCK_M + offs_m[:, None]) * BLOCK_D + offs_d[None, :])
    seen = l_tot > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_tot, 1.0)[:, None], 0.0)
    lse = tl.where(seen, g_safe + tl.log(tl.where(seen, l_tot, 1.0)), float("-inf"))
    hq = h * REP + offs_m // Tq
    tq = offs_m % Tq
    row_ok = offs_m < M
    row = (b * Hq + hq) * Tq + tq
    tl.store(OUT + row[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + row, lse, mask=row_ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


def _n_splits(n_programs: int, T: int, device) -> int:
    """Splits of a part's tokens: enough programs to fill the device (2 per SM on CUDA),
    no split under one tile; on the interpreter as few as the tiles allow (it is slow)."""
    tiles = -(-T // BLOCK_T)
    if device.type != "cuda":
        return min(tiles, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, -(-2 * sms // n_programs)))


def _side(parts_codes, parts_scale, parts_zp, lut, layout, device):
    check_layout(layout)
    lut_t = lut if lut is not None else torch.zeros(1, dtype=torch.float32, device=device)
    return [dict(codes=c, scale=s, zp=(zp if zp is not None else s), lut=lut_t)
            for c, s, zp in zip(parts_codes, parts_scale,
                                parts_zp if layout.has_zero_point else [None] * len(parts_codes), strict=True)]


def _check_tensors(q, tensors):
    for name, t in tensors:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}; allowed: every tensor on q's device")
        if t.dim() == 4 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} has last-dim stride {t.stride(-1)}; allowed: 1 (rows stored contiguously)")


def attention_parts(q, k_layout, k_parts, v_layout, v_parts, k_lut=None, v_lut=None, mask=None,
                    seg: int = 0, n_split: int | None = None):
    """The op form: ``k_parts``/``v_parts`` = lists of ``(codes, scale, zero point or None)``
    of consecutive token ranges (``seg`` tokens each but the last; one part when seg is 0),
    laid out as ``k_layout``/``v_layout`` say. ``n_split``: splits per part (default: fill
    the device). Returns ``(out, lse)`` float32."""
    if triton is None:
        raise ValueError("the Triton attention kernel needs triton (pip install 'lessmem[gpu]')")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton attention kernel runs on CUDA tensors (q is on {q.device}), or on "
                         "CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton "
                         "is imported)")
    B, Hq, Tq, D = q.shape
    if k_layout.head_dim != D or v_layout.head_dim != D:
        raise ValueError(f"layouts of head_dim {k_layout.head_dim}/{v_layout.head_dim}; allowed: q's D={D}")
    k_sizes, v_sizes = [p[0].shape[2] for p in k_parts], [p[0].shape[2] for p in v_parts]
    if not k_sizes or k_sizes != v_sizes or (len(k_sizes) > 1 and any(n != seg for n in k_sizes[:-1])):
        raise ValueError(f"key parts of {k_sizes} tokens, value parts of {v_sizes}, seg={seg}; allowed: "
                         "the same token counts on both sides, seg tokens in every part but the last")
    Hkv = k_parts[0][0].shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of the KV heads {Hkv}")
    if mask is not None and tuple(mask.shape) != (B, Tq, sum(k_sizes)):
        raise ValueError(f"mask must be [B, Tq, T] = {(B, Tq, sum(k_sizes))}, got {tuple(mask.shape)}")
    rep = Hq // Hkv
    M = rep * Tq
    BM, BD = _pow2(M), _pow2(D)
    dev = q.device
    q = q.float().contiguous()
    ks = _side([p[0] for p in k_parts], [p[1] for p in k_parts], [p[2] for p in k_parts], k_lut, k_layout, dev)
    vs = _side([p[0] for p in v_parts], [p[1] for p in v_parts], [p[2] for p in v_parts], v_lut, v_layout, dev)
    _check_tensors(q, [(f"{side} part {i} {k}", t) for side, parts in (("key", ks), ("value", vs))
                       for i, p in enumerate(parts) for k, t in p.items()]
                   + ([("mask", mask)] if mask is not None else []))
    sizes = [p["codes"].shape[2] for p in ks]
    plan = []  # (tokens per split, splits) of each part: whole tiles per split
    for n in sizes:
        want = max(1, min(n_split or _n_splits(B * Hkv, n, dev), -(-n // BLOCK_T)))
        per = -(-n // want)
        per = -(-per // BLOCK_T) * BLOCK_T
        plan.append((per, -(-n // per)))
    total = sum(ns for _, ns in plan)
    pm = torch.empty(B * Hkv * total * BM, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * Hkv * total * BM * BD, dtype=torch.float32, device=dev)
    if mask is not None:
        mask = mask.float()
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_args = (mask, mask.stride(0), mask.stride(1))
    else:
        mask_args = (q, 0, 0)
    kl, vl = k_layout, v_layout
    off = 0
    t0 = 0
    for kp, vp, n, (per, ns) in zip(ks, vs, sizes, plan, strict=True):
        kc, ksc, kz, vc, vsc, vz = kp["codes"], kp["scale"], kp["zp"], vp["codes"], vp["scale"], vp["zp"]
        _partial[(B * Hkv, ns)](
            q, q.stride(0), q.stride(1), q.stride(2),
            kc, kc.stride(0), kc.stride(1), kc.stride(2), ksc, ksc.stride(0), ksc.stride(1), ksc.stride(2),
            kz, kz.stride(0), kz.stride(1), kz.stride(2), kp["lut"], float(kl.zero_const),
            vc, vc.stride(0), vc.stride(1), vc.stride(2), vsc, vsc.stride(0), vsc.stride(1), vsc.stride(2),
            vz, vz.stride(0), vz.stride(1), vz.stride(2), vp["lut"], float(vl.zero_const),
            *mask_args, t0, pm, pl, pacc,
            Hkv, Tq, M, D, n, per, off, total,
            K_BITS=kl.bits, K_PACK=PACKINGS[kl.packing], K_TG=kl.token_group, K_DG=kl.channel_group,
            K_ZP=kl.has_zero_point, K_LUT=kl.levels is not None,
            V_BITS=vl.bits, V_PACK=PACKINGS[vl.packing], V_TG=vl.token_group, V_DG=vl.channel_group,
            V_ZP=vl.has_zero_point, V_LUT=vl.levels is not None,
            HAS_MASK=mask is not None, REP=rep, BLOCK_M=BM, BLOCK_T=BLOCK_T, BLOCK_D=BD)
        off += ns
        t0 += n
    out = torch.empty(B, Hq, Tq, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=dev)
    _combine[(B * Hkv,)](pm, pl, pacc, out, lse, Hkv, Hq, Tq, M, D, total, REP=rep, BLOCK_M=BM, BLOCK_D=BD)
    return out, lse


def triton_attention(q: torch.Tensor, kv, mask: torch.Tensor | None = None, n_split: int | None = None):
    """(out float32 [B, Hq, Tq, D], lse [B, Hq, Tq]) of ``q`` over a QuantKV or SegmentedKV
    on q's device (CUDA: compiled; CPU: Triton's interpreter). ``mask``: additive [B, Tq, T]."""
    if hasattr(kv, "k_parts"):  # SegmentedKV: its parts, read in place
        k, v = kv.k, kv.v
        return attention_parts(q, k.layout, kv.k_parts, v.layout, kv.v_parts, k.layout.lut(q.device),
                               v.layout.lut(q.device), mask, kv.seg, n_split)
    k, v = kv.keys, kv.values
    return attention_parts(q, k.layout, [(k.codes, k.scale, k.zero_point)], v.layout,
                           [(v.codes, v.scale, v.zero_point)], k.layout.lut(q.device),
                           v.layout.lut(q.device), mask, 0, n_split)
