"""Fused quantized attention (C++ and torch paths) against the dequantize-everything reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lessmem.formats.kvlayout import KVLayout
from lessmem.kernels.attention import QuantKV, QuantSide, cpp_available, quantized_attention
from lessmem.kernels.attention_reference import attention_reference, dequantize_side, unpack_codes

# (bits, tg, dg, kind): kind "zp" = uint8 zero points, "sym" = constant zero, "lut" = level table
CASES = [(4, 1, 64, "zp"), (4, 32, 1, "zp"), (2, 32, 1, "zp"), (2, 1, 32, "sym"), (3, 64, 1, "zp"),
         (3, 1, 16, "sym"), (8, 1, 64, "sym"), (8, 1, 64, "lut"), (2, 16, 1, "lut"), (3, 1, 64, "lut"),
         (4, 1, 64, "lut"), (2, 1, 64, "lut")]


def _side(g, B, H, T, D, bits, tg, dg, kind):
    codes = torch.randint(0, 256, (B, H, T, D * bits // 8), dtype=torch.uint8, generator=g)
    scale = (torch.rand(B, H, T // tg, D // dg, generator=g) * 0.2 + 0.01).half()
    zp = lut = None
    zc = 0.0
    if kind == "zp":
        zp = torch.randint(0, 2**bits, (B, H, T // tg, D // dg), dtype=torch.uint8, generator=g)
    elif kind == "sym":
        zc = 2.0 ** (bits - 1)
    else:
        lut = torch.randn(2**bits, generator=g)
    layout = KVLayout(bits, D, dg, tg, has_zero_point=zp is not None, zero_const=zc,
                      levels=None if lut is None else tuple(lut.tolist()))
    return QuantSide(codes, scale, zp, layout)


@pytest.mark.parametrize("bits,tg,dg,kind", CASES)
@pytest.mark.parametrize("use_cpp", [True, False])
def test_fused_matches_reference(bits, tg, dg, kind, use_cpp):
    g = torch.Generator().manual_seed(bits * 100 + tg + dg)
    B, Hkv, Hq, Tq, T, D = 2, 2, 6, 3, 192, 64
    kv = QuantKV(_side(g, B, Hkv, T, D, bits, tg, dg, kind), _side(g, B, Hkv, T, D, bits, tg, dg, kind))
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.1
    mask = torch.zeros(B, Tq, T)
    mask[1, :, :40] = float("-inf")  # left padding of row 1
    mask[0, 2, 100:] = float("-inf")
    out, lse = quantized_attention(q, kv, mask, use_cpp=use_cpp)
    ref, ref_lse = attention_reference(q, kv, mask)
    # float32 accumulation in a different order: relative 1e-5 of the value scale
    tol = 1e-5 * float(ref.abs().max()) + 1e-6
    assert (out - ref).abs().max() <= tol * 10
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


FOLDED = {  # (keys, values) as (bits, tg, dg, kind): the layouts the register paths (AVX-512, AVX2) read
    "best-4": ((4, 64, 1, "zp"), (4, 1, 64, "zp")), "kivi-4": ((4, 32, 1, "zp"), (4, 1, 64, "zp")),
    "best-2": ((3, 64, 1, "zp"), (2, 1, 64, "zp")), "int8": ((8, 1, 64, "sym"), (8, 1, 64, "sym")),
    "int4": ((4, 1, 64, "zp"), (4, 1, 64, "zp"))}


@pytest.mark.parametrize("Hq", [3, 9])
@pytest.mark.parametrize("Tq", [1, 2, 5])
@pytest.mark.parametrize("layout", list(FOLDED))
def test_folded_layouts_match_reference(Hq, Tq, layout):
    """Keys folded per channel or per token, values folded per token, 64 channels: 1, 2, 5,
    3, 6 and 15 query rows per KV head (the register paths' row blocks of up to four and
    their remainders), segments of 128 tokens, a masked row."""
    g = torch.Generator().manual_seed(Tq * 10 + len(layout) + Hq)
    B, Hkv, T, D = 1, 3, 384, 64
    (kb, ktg, kdg, kk), (vb, vtg, vdg, vk) = FOLDED[layout]
    kv = QuantKV(_side(g, B, Hkv, T, D, kb, ktg, kdg, kk), _side(g, B, Hkv, T, D, vb, vtg, vdg, vk))
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.1
    mask = torch.zeros(B, Tq, T)
    mask[0, -1, 200:] = float("-inf")
    ref, ref_lse = attention_reference(q, kv, mask)
    outs = []
    for hist in (kv, _segments(kv, [0, 128, 256, 384], 128)):
        out, lse = quantized_attention(q, hist, mask, use_cpp=True)
        assert (out - ref).abs().max() <= 1e-4 * float(ref.abs().max()) + 1e-6
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
        outs.append(out)
    if ktg == 1:  # 16-token segments: tiles of 32 cross them, and compute as the joined history
        outs.append(quantized_attention(q, _segments(kv, list(range(0, T + 1, 16)), 16), mask, use_cpp=True)[0])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])  # segments change nothing, bit for bit


def test_splits_fill_the_threads_evenly():
    """Each (batch, KV head)'s history is split so that the work items are a multiple of the
    threads (3 KV heads on 2 threads: 4 splits, not 3, which left a thread idle), about four
    a thread, and no split is shorter than 128 tokens."""
    from lessmem.kernels.attention import _n_split

    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4, 8):
            torch.set_num_threads(threads)
            for bh in range(1, 13):
                n = _n_split(1, bh, 1 << 20)
                assert (n * bh) % threads == 0 and n * bh >= min(4 * threads, bh), (threads, bh, n)
                assert n <= 4 * threads
                assert _n_split(1, bh, 300) <= 2 and _n_split(1, bh, 100) == 1
        torch.set_num_threads(2)
        assert _n_split(1, 3, 16384) == 4 and _n_split(2, 3, 16384) == 2
    finally:
        torch.set_num_threads(before)


def test_cpp_kernel_builds_here():
    # the CI machines have a compiler; the fallback is still tested above
    assert cpp_available()


def test_fully_masked_rows_give_zero_and_minus_inf():
    g = torch.Generator().manual_seed(1)
    kv = QuantKV(_side(g, 1, 1, 64, 64, 4, 1, 64, "zp"), _side(g, 1, 1, 64, 64, 4, 1, 64, "zp"))
    q = torch.randn(1, 2, 2, 64, generator=g)
    mask = torch.zeros(1, 2, 64)
    mask[0, 0] = float("-inf")
    for use_cpp in (True, False):
        out, lse = quantized_attention(q, kv, mask, use_cpp=use_cpp)
        assert torch.all(out[:, :, 0] == 0) and torch.all(torch.isneginf(lse[:, :, 0]))
        assert torch.isfinite(out).all()


def test_empty_history_and_bad_shapes():
    g = torch.Generator().manual_seed(2)
    kv = QuantKV(_side(g, 1, 2, 0, 64, 4, 1, 64, "zp"), _side(g, 1, 2, 0, 64, 4, 1, 64, "zp"))
    out, lse = quantized_attention(torch.randn(1, 4, 1, 64), kv)
    assert out.abs().sum() == 0 and torch.isneginf(lse).all()
    kv = QuantKV(_side(g, 1, 2, 32, 64, 4, 1, 64, "zp"), _side(g, 1, 2, 32, 64, 4, 1, 64, "zp"))
    with pytest.raises(ValueError, match="query heads 3 must be a multiple of the KV heads 2"):
        quantized_attention(torch.randn(1, 3, 1, 64), kv)
    with pytest.raises(ValueError, match=r"mask must be \[B, Tq, T\]"):
        quantized_attention(torch.randn(1, 4, 1, 64), kv, torch.zeros(1, 1, 31))
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, Tq, D\]"):
        quantized_attention(torch.randn(4, 1, 64), kv)


def test_split_layout_unpacking_is_what_the_doc_says():
    # 4-bit: byte j holds channel j (low nibble) and channel j + D/2 (high nibble)
    codes = torch.tensor([[[[0x21, 0x43]]]], dtype=torch.uint8)
    layout = KVLayout(bits=4, head_dim=4, channel_group=4, zero_const=1.0)
    assert unpack_codes(codes, layout).tolist() == [[[[1, 3, 2, 4]]]]
    side = QuantSide(codes, torch.full((1, 1, 1, 1), 0.5).half(), None, layout)
    assert dequantize_side(side, 4).tolist() == [[[[0.0, 1.0, 0.5, 1.5]]]]
    assert torch.equal(layout.unpack(codes), unpack_codes(codes, layout))  # the production unpacker too


@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True)])
def test_one_call_history_plus_full_precision(causal, masked):
    from lessmem.kernels.attention import fused_attention

    g = torch.Generator().manual_seed(7)
    B, Hkv, Hq, Tq, T, Lf, D = 2, 2, 4, 3, 96, 20, 64
    kv = QuantKV(_side(g, B, Hkv, T, D, 4, 32, 1, "zp"), _side(g, B, Hkv, T, D, 4, 1, 64, "zp"))
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.1
    kf, vf = torch.randn(B, Hkv, Lf, D, generator=g), torch.randn(B, Hkv, Lf, D, generator=g)
    mask = torch.zeros(B, Tq, T + Lf)
    if masked:
        mask[1, :, :30] = float("-inf")
        mask[0, 1, T + 5:] = float("-inf")
    if causal:
        mask[:, :, T:] = torch.where(torch.arange(Lf)[None, :] <= torch.arange(Tq)[:, None] + Lf - Tq,
                                     0.0, float("-inf"))
    res = fused_attention(q, kv, mask[..., :T] if masked else None, q, kf, vf,
                          mask[..., T:] if masked else None, causal)
    if res is None:
        pytest.skip("no C++ compiler: the one-call path is C++ only (the caller falls back)")
    out_h, out_f, _ = res
    k = torch.cat([dequantize_side(kv.keys, D), kf], 2).repeat_interleave(2, 1)
    v = torch.cat([dequantize_side(kv.values, D), vf], 2).repeat_interleave(2, 1)
    p = torch.softmax(q @ k.transpose(-1, -2) + mask[:, None], dim=-1)
    torch.testing.assert_close(out_f + out_h, p @ v, atol=1e-4, rtol=1e-4)


def _segments(kv: QuantKV, bounds, seg):
    from lessmem.kernels.attention import SegmentedKV

    def parts(side):
        return tuple((x.codes, x.scale, x.zero_point) for x in
                     (side.slice_tokens(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False)))
    return SegmentedKV(kv.keys, kv.values, parts(kv.keys), parts(kv.values), seg)


@pytest.mark.parametrize("bits,tg,dg,kind", CASES)
def test_segmented_history_is_bit_exact_with_the_joined_one(bits, tg, dg, kind):
    # blocks fetched from different tiers are read in place: same result, bit for bit
    from lessmem.kernels.attention import fused_attention

    g = torch.Generator().manual_seed(7 + bits + tg)
    B, Hkv, Hq, Tq, T, D = 2, 2, 6, 1, 448, 64
    kv = QuantKV(_side(g, B, Hkv, T, D, bits, tg, dg, kind), _side(g, B, Hkv, T, D, bits, tg, dg, kind))
    segs = _segments(kv, [0, 128, 256, 384, 448], 128)  # three full segments and a partial one
    assert segs.n_tokens == T and segs.n_kv_heads == Hkv
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.1
    mask = torch.zeros(B, Tq, T)
    mask[1, :, :40] = float("-inf")
    out, lse = quantized_attention(q, kv, mask)
    out_s, lse_s = quantized_attention(q, segs, mask)
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s)
    kf, vf = torch.randn(B, Hkv, 5, D, generator=g), torch.randn(B, Hkv, 5, D, generator=g)
    one = fused_attention(q, kv, mask, q, kf, vf, None, False)
    many = fused_attention(q, segs, mask, q, kf, vf, None, False)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    # the torch path and the reference read the joined parts
    out_t, _ = quantized_attention(q, segs, mask, use_cpp=False)
    ref, _ = attention_reference(q, kv, mask)
    assert (out_t - ref).abs().max() <= 1e-4 * float(ref.abs().max()) + 1e-6
    assert torch.equal(segs.keys.codes, kv.keys.codes) and torch.equal(segs.values.scale, kv.values.scale)


def test_segmented_history_converts_odd_parts_in_the_kernel():
    # a non-contiguous part or fp32 scales are converted (and kept alive) by the C++ side
    g = torch.Generator().manual_seed(5)
    kv = QuantKV(_side(g, 1, 2, 128, 64, 4, 32, 1, "zp"), _side(g, 1, 2, 128, 64, 4, 1, 64, "zp"))
    segs = _segments(kv, [0, 64, 128], 64)
    k0 = segs.k_parts[0]
    odd = (k0[0].transpose(1, 2).contiguous().transpose(1, 2), k0[1].float(), k0[2])
    assert not odd[0].is_contiguous()
    segs2 = type(segs)(segs.k, segs.v, (odd, *segs.k_parts[1:]), segs.v_parts, 64)
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert torch.equal(quantized_attention(q, segs2)[0], quantized_attention(q, kv)[0])



def test_pointer_table_entries_are_remembered_on_stored_parts():
    # a serving layer's history is made anew over the same pages each time a page is added: each
    # page's entries of the kernel's pointer table are kept on its codes tensor and reused; a part
    # the kernel reads through a converted copy (fp32 scales) is converted again every time
    from lessmem.kernels import attention as A

    if not cpp_available():
        pytest.skip("no C++ compiler: the pointer table is the C++ kernel's")
    g = torch.Generator().manual_seed(9)
    kv = QuantKV(_side(g, 1, 2, 192, 64, 4, 32, 1, "zp"), _side(g, 1, 2, 192, 64, 4, 1, 64, "zp"))

    def pages(side):
        return [tuple(t.contiguous() for t in (p.codes, p.scale, p.zero_point))
                for p in (side.slice_tokens(a, a + 64) for a in (0, 64, 128))]
    pk, pv = pages(kv.keys), pages(kv.values)

    def hist(n, k_parts=pk):
        return A.SegmentedKV(kv.keys, kv.values, tuple(k_parts[:n]), tuple(pv[:n]), 64)
    A._kernel_table(hist(2))
    assert all("_lessmem_segment" in c.__dict__ for c, _, _ in pk[:2] + pv[:2])
    table = A._kernel_table(hist(3))
    for c, _, _ in pk + pv:
        c.__dict__.pop("_lessmem_segment")
    assert torch.equal(table, A._kernel_table(hist(3)))  # the same entries made afresh
    q = torch.randn(1, 4, 64, generator=g).repeat(2, 1, 1)  # two rows over the same history
    cur = [(torch.randn(1, 2, 3, 64, generator=g), torch.randn(1, 2, 3, 64, generator=g))]
    want = A.fused_attention_rows(q[:1], 0.125, None, None, [kv], [cur])
    got = A.fused_attention_rows(q, 0.125, None, None, [hist(3), hist(3)], [cur, cur])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[0])
    odd = [(pk[0][0].clone(), pk[0][1].float(), pk[0][2]), *pk[1:]]
    got = A.fused_attention_rows(q[:1], 0.125, None, None, [hist(3, odd)], [cur])
    assert "_lessmem_segment" not in odd[0][0].__dict__ and torch.equal(got, want)


def test_segmented_history_rejects_uneven_parts():
    g = torch.Generator().manual_seed(3)
    kv = QuantKV(_side(g, 1, 1, 96, 64, 4, 32, 1, "zp"), _side(g, 1, 1, 96, 64, 4, 1, 64, "zp"))
    with pytest.raises(ValueError, match="every part but the last"):
        _segments(kv, [0, 32, 96], 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        _segments(kv, [0, 16, 32], 16)
    # values cut differently from the keys: the kernel would read past a value part
    from lessmem.kernels.attention import SegmentedKV

    segs = _segments(kv, [0, 64, 96], 64)
    short = tuple((c[:, :, :8], sc[:, :, :8], z[:, :, :8]) for c, sc, z in segs.v_parts[1:])
    with pytest.raises(ValueError, match="keys and values alike"):
        SegmentedKV(segs.k, segs.v, segs.k_parts, (segs.v_parts[0], *short), 64)


@pytest.mark.parametrize("bits,packing,kind", [(1, "split", "zp"), (5, "stream", "sym"), (4, "stream", "lut"),
                                               (2, "stream", "zp"), (8, "stream", "sym")])
def test_layouts_the_cache_does_not_use_yet_work_from_their_description(bits, packing, kind):
    # the kernels read the packing from the layout: no per-bits code is needed for these
    g = torch.Generator().manual_seed(40 + bits)
    B, Hkv, Hq, Tq, T, D = 1, 2, 4, 2, 96, 64

    def side(tg, dg):
        s = _side(g, B, Hkv, T, D, bits, tg, dg, kind)
        return QuantSide(s.codes, s.scale, s.zero_point, dataclasses.replace(s.layout, packing=packing))
    kv = QuantKV(side(32, 1), side(1, 16))
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.1
    ref, ref_lse = attention_reference(q, kv)
    for use_cpp in (True, False):
        out, lse = quantized_attention(q, kv, use_cpp=use_cpp)
        assert (out - ref).abs().max() <= 1e-4 * float(ref.abs().max()) + 1e-6
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)

# That no production module imports attention_reference (the tests' oracle; the torch
# fallback is attention_torch) is checked, with every other *_reference oracle, by
# tests/kernels/test_fallbacks.py::test_no_production_module_imports_a_test_oracle.


@pytest.mark.parametrize("bits,tg,dg,kind", CASES)
def test_batch_of_requests_equals_each_alone_and_the_reference(bits, tg, dg, kind):
    # a serving step: ragged requests (own history length, segments, fp pieces of fp32 or
    # fp16) in one call; each equals itself in a batch of one, bit for bit, and the reference
    from lessmem.kernels.attention import fused_attention_batch

    g = torch.Generator().manual_seed(11 + bits + tg + dg)
    Hkv, Hq, D = 2, 6, 64
    hists, pieces, refs = [], [], []
    for i, T in enumerate([64, 320, 128 + 64 * (tg == 1)]):
        kv = QuantKV(_side(g, 1, Hkv, T, D, bits, tg, dg, kind), _side(g, 1, Hkv, T, D, bits, tg, dg, kind))
        if hists:  # one format for all requests (a "lut" side draws its own levels)
            kv = QuantKV(dataclasses.replace(kv.keys, layout=refs[0][0].keys.layout),
                         dataclasses.replace(kv.values, layout=refs[0][0].values.layout))
        hists.append(_segments(kv, [*range(0, T, 64), T], 64) if i == 1 else kv)
        dt = torch.float16 if i != 2 else torch.float32
        ps = [(torch.randn(1, Hkv, n, D, generator=g).to(dt), torch.randn(1, Hkv, n, D, generator=g).to(dt))
              for n in (4, 30 + i)] + [(torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g))]
        pieces.append(ps)
        refs.append((kv, ps))
    q = torch.randn(3, Hq, D, generator=g) * 0.1
    res = fused_attention_batch(q, q * 0.5, hists, pieces)
    if res is None:
        pytest.skip("no C++ compiler: the batched path is C++ only (the caller falls back)")
    out_h, out_f = res
    for r, (kv, ps) in enumerate(refs):
        one_h, one_f = fused_attention_batch(q[r:r + 1], q[r:r + 1] * 0.5, [hists[r]], [ps])
        assert torch.equal(one_h[0], out_h[r]) and torch.equal(one_f[0], out_f[r])
        kf = torch.cat([p[0].float() for p in ps], 2)
        vf = torch.cat([p[1].float() for p in ps], 2)
        s = torch.cat([q[r][None, :, None] @ dequantize_side(kv.keys, D).repeat_interleave(3, 1).transpose(-1, -2),
                       (q[r] * 0.5)[None, :, None] @ kf.repeat_interleave(3, 1).transpose(-1, -2)], -1)
        p = torch.softmax(s, -1)
        nh = kv.n_tokens
        want_h = p[..., :nh] @ dequantize_side(kv.values, D).repeat_interleave(3, 1)
        want_f = p[..., nh:] @ vf.repeat_interleave(3, 1)
        torch.testing.assert_close(out_h[r], want_h[0, :, 0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_f[r], want_f[0, :, 0], atol=1e-4, rtol=1e-4)


def test_batch_of_requests_refuses_mixed_formats_and_bad_pieces():
    from lessmem.kernels.attention import cpp_available, fused_attention_batch, fused_attention_rows

    if not cpp_available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(3)
    a = QuantKV(_side(g, 1, 2, 64, 64, 4, 1, 64, "zp"), _side(g, 1, 2, 64, 64, 4, 1, 64, "zp"))
    b = QuantKV(_side(g, 1, 2, 64, 64, 8, 1, 64, "sym"), _side(g, 1, 2, 64, 64, 4, 1, 64, "zp"))
    cur = [(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))]
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="one format for all"):
        fused_attention_batch(q, q, [a, b], [cur, cur])
    with pytest.raises(ValueError, match="one format for all"):
        fused_attention_rows(q, 0.5, None, None, [a, b], [cur, cur])
    bad = [(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 3, 64))]  # values of another length
    with pytest.raises(RuntimeError, match="keys and values of one shape"):
        fused_attention_batch(q[:1], q[:1], [a], [bad])
    # a piece the kernel cannot read in place (keys fp32, values fp16; strided rows) is
    # converted for the call: the same result as the float32 contiguous piece
    k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    want = fused_attention_batch(q[:1], q[:1], [a], [[(k, v)]])
    wide = torch.randn(1, 2, 5, 128)
    wide[..., ::2] = k
    for odd in ((k, v.half().float()), (wide[..., ::2], v)):
        got = fused_attention_batch(q[:1], q[:1], [a], [[odd]])
        torch.testing.assert_close(got[0], want[0])
    mixed = fused_attention_batch(q[:1], q[:1], [a], [[(k, v.half())]])
    torch.testing.assert_close(mixed[1], want[1], atol=1e-3, rtol=1e-3)


def test_rows_call_scales_and_sums_as_torch_would():
    """``fused_attention_rows`` (the lean step's one call: q scaled inside, the two parts
    summed inside) equals the batch call on ``q * scale`` (torch's multiply) with
    ``out_f + out_h`` (torch's add), bit for bit."""
    from lessmem.kernels.attention import cpp_available, fused_attention_batch, fused_attention_rows

    if not cpp_available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(5)
    kv = QuantKV(_side(g, 1, 2, 96, 64, 4, 1, 64, "zp"), _side(g, 1, 2, 96, 64, 4, 1, 64, "zp"))
    cur = [(torch.randn(1, 2, 7, 64, generator=g), torch.randn(1, 2, 7, 64, generator=g))]
    q = torch.randn(1, 4, 64, generator=g)
    scale = 0.1234567891234  # not a float32 number: rounded once, as torch does
    out_h, out_f = fused_attention_batch(q * scale, q * scale, [kv], [cur])
    assert torch.equal(fused_attention_rows(q, scale, None, None, [kv], [cur]), out_f + out_h)


MIXED = [(4,) * 8 + (3,) * 16 + (2,) * 24 + (0,) * 16, (8,) * 8 + (5,) * 8 + (1,) * 40 + (0,) * 8]


@pytest.mark.parametrize("case", CASES + [("mixed", cb) for cb in MIXED])
def test_to_float_decodes_as_the_reference(case):
    # the prefill's slices of the history go to flash attention as floats: the C++ decoder
    # (one allocation) must give what the reference dequantization gives, for every layout
    # and for slices of a history (views: rows of each head not adjacent), odd lengths too
    g = torch.Generator().manual_seed(7)
    B, H, T, D = 2, 3, 192, 64
    if case[0] == "mixed":
        cb = case[1]
        lay = KVLayout(bits=max(cb), head_dim=D, channel_group=1, token_group=32, has_zero_point=True,
                       channel_bits=cb)
        u = torch.stack([torch.randint(0, 2**b, (B, H, T), generator=g) for b in cb], -1)
        zp = torch.randint(0, 4, (B, H, T // 32, D), dtype=torch.uint8, generator=g)
        side = QuantSide(lay.pack(u), (torch.rand(B, H, T // 32, D, generator=g) * 0.2 + 0.01).half(), zp, lay)
    else:
        side = _side(g, B, H, T, D, *case)
    for t0, t1 in [(0, T), (64, 192), (0, 96), (0, 37 if side.tg == 1 else 96)]:
        s = side.slice_tokens(t0, t1)  # (a last group cut short: the reference reads whole groups)
        ref = dequantize_side(side.slice_tokens(t0, -(-t1 // side.tg) * side.tg))[:, :, :t1 - t0]
        got = s.to_float()
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-6 * float(ref.abs().max()) + 1e-7, rtol=1e-6)
        torch.testing.assert_close(s.dequantize(), ref, atol=1e-6 * float(ref.abs().max()) + 1e-7, rtol=1e-6)
    if cpp_available():  # the C++ decoder ran: its output is the kernel's, not the torch path's
        import lessmem.kernels.attention as A
        assert A._module() is not None
