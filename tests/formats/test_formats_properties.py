"""Property tests over bits × granularity × shape × dtype (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lessmem.formats import PerChannel, PerGroup, PerTensor, PerToken, SuperBlock, quantize, snr_db
from lessmem.formats._reference import pack_bits_reference
from lessmem.formats.integer import _effective_qparams, grouped_codes
from lessmem.formats.packing import pack_bits, packed_nbytes, unpack_bits

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)  # CI: the same examples every run
INT_BITS = [2, 3, 4, 5, 6, 8]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def int_cases(draw, superblock: bool = True):
    """(x, fmt name, granularity, scale dtype) with a shape that fits the granularity."""
    bits = draw(st.sampled_from(INT_BITS))
    sym = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    kinds = ["tensor", "channel", "token", "group"] + (["super"] if superblock else [])
    kind = draw(st.sampled_from(kinds))
    rows = draw(st.integers(1, 6))
    if kind == "group":
        size = draw(st.sampled_from([4, 8, 16, 32]))
        gran, shape = PerGroup(size), (rows, size * draw(st.integers(1, 4)))
    elif kind == "super":
        gran, shape = SuperBlock(64, draw(st.sampled_from([8, 16, 32]))), (rows, 64 * draw(st.integers(1, 2)))
    else:
        cols = draw(st.integers(1, 40))
        if draw(st.booleans()):
            shape = (rows, 2, cols)
        else:
            shape = (rows, cols)
        gran = {"tensor": PerTensor(), "channel": PerChannel(0), "token": PerToken()}[kind]
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-2, 1.0, 37.0, 1e3]))
    shift = draw(st.sampled_from([0.0, 0.5, -2.0]))
    g = torch.Generator().manual_seed(seed)
    x = ((torch.randn(shape, generator=g) + shift) * magnitude).to(dtype)
    scale_dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    return x, f"{'int' if sym else 'uint'}{bits}", gran, scale_dtype


@SETTINGS
@given(bits=st.integers(1, 8), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_identity_and_reference(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert packed.tolist() == pack_bits_reference(codes.tolist(), bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@SETTINGS
@given(int_cases())
def test_rtn_error_at_most_half_a_step(case):
    """|x - x̂| <= s/2 per group with the scale actually used (SuperBlock: c·d)."""
    x, fmt, gran, scale_dtype = case
    qt = quantize(x, fmt, granularity=gran, scale_dtype=scale_dtype)
    scale, _ = _effective_qparams(qt)
    xg, _ = gran.group(x.float())
    x_hat, _ = gran.group(qt.dequantize(torch.float32))
    bound = scale.float().unsqueeze(1) * 0.5 * (1 + 1e-5) + 1e-6 * xg.abs()
    assert bool(((xg - x_hat).abs() <= bound).all())


@SETTINGS
@given(int_cases(superblock=False))
def test_quantize_dequantize_idempotent(case):
    """Quantizing a reconstruction gives the same codes and the same reconstruction.

    Not for SuperBlock, and asymmetric formats only with fp32 scales: those scales are
    rounded *up* to the storage dtype (which is what keeps |x - x̂| <= s/2), so with a
    coarse fp16 scale the reconstruction may not reach the top code, and min/max of the
    reconstruction then give a smaller scale. An fp32 round-up is too small to matter.
    Nor when a group's lower end lies exactly half a step from a code (−lo/s = k + ½, common
    with bf16 inputs: lo = −1.25, s = 0.5): the zero point rounds half to even, both ends move
    inward and the reconstruction's range is a step shorter (seen: uint3, [−1.25, 2.25]).
    """
    x, fmt, gran, scale_dtype = case
    if fmt.startswith("uint"):
        scale_dtype = torch.float32
    qt = quantize(x, fmt, granularity=gran, scale_dtype=scale_dtype)
    if fmt.startswith("uint"):
        xg = gran.group(x.float())[0]
        t = -xg.amin(dim=1).clamp(max=0) / _effective_qparams(qt)[0].flatten().float()
        assume(not bool(((t - t.floor()) == 0.5).any()))
    x_hat = qt.dequantize(torch.float32)
    qt2 = quantize(x_hat, fmt, granularity=gran, scale_dtype=scale_dtype)
    assert torch.equal(grouped_codes(qt2), grouped_codes(qt))
    x_hat2 = qt2.dequantize(torch.float32)
    assert torch.allclose(x_hat2, x_hat, rtol=1e-6, atol=0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sym=st.booleans(),
       gran=st.sampled_from([PerTensor(), PerChannel(0), PerGroup(32), SuperBlock(256, 32)]),
       dtype=st.sampled_from(DTYPES))
def test_snr_increases_with_bits(seed, sym, gran, dtype):
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
    snrs = [snr_db(x.float(), quantize(x, f"{'int' if sym else 'uint'}{b}", granularity=gran)
                   .dequantize(torch.float32)) for b in INT_BITS]
    assert all(a < b for a, b in zip(snrs, snrs[1:], strict=False)), snrs
