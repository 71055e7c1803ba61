"""Lloyd-Max codebooks: levels, exact nearest assignment, data fit, scales, bytes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lessmem.formats import PerChannel, PerGroup, PerTensor, PerToken, SuperBlock, quantize, snr_db
from lessmem.formats._reference import codebook_assign_reference, gaussian_lloyd_max_reference
from lessmem.formats.codebook import (
    _candidate_scales,
    assign,
    codebook_indices,
    fit_codebook,
    gaussian_codebook,
    quantize_codebook,
)

# Max (1960), Table I: positive Lloyd-Max levels for N(0, 1)
MAX_1960 = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326],
}
# mean squared error of those quantizers (σ² = 1)
MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_levels_match_max_1960(bits):
    c = gaussian_codebook(bits)
    assert c.shape == (2**bits,) and c.dtype == torch.float32
    assert torch.allclose(c[2 ** (bits - 1):], torch.tensor(MAX_1960[bits]), atol=1e-4)
    assert torch.equal(c, -c.flip(0))  # symmetric
    assert bool((c[1:] > c[:-1]).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_gaussian_levels_match_numerical_reference(bits):
    ref = torch.tensor(gaussian_lloyd_max_reference(bits), dtype=torch.float64)
    assert torch.allclose(gaussian_codebook(bits).double(), ref, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_distortion_matches_theory(bits):
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(bits))
    qt = quantize(x, f"lm{bits}", granularity=PerTensor(), norm="rms", scale_dtype=torch.float32)
    expected = 10 * math.log10(1 / MSE[bits])
    assert snr_db(x, qt.dequantize()) == pytest.approx(expected, abs=0.05)


def test_assignment_matches_argmin_reference_including_ties():
    c = gaussian_codebook(3)
    mids = ((c[1:].double() + c[:-1].double()) / 2).float()
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.full_like(mids, -math.inf))
    rnd = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 1.5
    xn = torch.cat([rnd, mids, up, down, c, torch.tensor([-1e3, 1e3, 0.0])])
    assert torch.equal(assign(xn, c).long(), codebook_assign_reference(xn, c))
    c6 = gaussian_codebook(6)  # the bucketize path (> 32 levels)
    xn6 = torch.cat([rnd * 2, ((c6[1:].double() + c6[:-1].double()) / 2).float(), c6])
    assert torch.equal(assign(xn6, c6).long(), codebook_assign_reference(xn6, c6))
    # a tie goes to the lower level
    lv = torch.tensor([-1.0, 1.0])
    assert assign(torch.tensor([0.0]), lv).item() == 0


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       fit=st.sampled_from(["gaussian", "data"]), norm=st.sampled_from(["best", "rms", "absmax"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       gran=st.sampled_from([PerGroup(16), PerGroup(32), PerToken(), PerChannel(0), PerTensor()]))
def test_quantize_matches_reference(bits, seed, fit, norm, dtype, gran):
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    x[1, :16] = 0  # an all-zero group for the group granularities
    qt = quantize(x, f"lm{bits}", granularity=gran, fit=fit, norm=norm)
    xg, _ = gran.group(x)
    xn = xg.float() / torch.where(qt.scale == 0, 1.0, qt.scale.float()).unsqueeze(1)
    idx = codebook_indices(qt).long()
    assert torch.equal(idx, codebook_assign_reference(xn, qt.extra["codebook"]))
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == dtype
    # reconstruction is s · c[idx], element by element
    manual = qt.extra["codebook"][idx] * qt.scale.float().unsqueeze(1)
    assert torch.equal(gran.group(qt.dequantize(torch.float32))[0], manual)


def test_best_norm_is_never_worse_than_either_candidate_per_group():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 4
    x[::7, ::13] *= 8  # some groups with spikes
    gran = PerGroup(32)
    xg, _ = gran.group(x)
    c = gaussian_codebook(3)

    def group_err(qt):
        return (xg - gran.group(qt.dequantize(torch.float32))[0]).double().pow(2).sum(1)

    best = group_err(quantize_codebook(x, 3, gran, norm="best"))
    for norm in ("rms", "absmax"):
        other = group_err(quantize_codebook(x, 3, gran, norm=norm))
        assert bool((best <= other * (1 + 1e-5)).all())
    rms, amax = _candidate_scales(xg.float(), c, "best", torch.float16)
    chosen = quantize_codebook(x, 3, gran).scale
    assert bool(((chosen == rms) | (chosen == amax)).all())


@pytest.mark.parametrize("fit", ["gaussian", "data"])
def test_snr_increases_with_bits(fit):
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    snrs = [snr_db(x, quantize(x, f"lm{b}", fit=fit).dequantize()) for b in range(1, 7)]
    assert all(a + 3.0 < b for a, b in zip(snrs, snrs[1:], strict=False)), snrs


def test_beats_uniform_int_at_equal_bits_and_scales():
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(3))
    for bits in (2, 3, 4):
        lm = snr_db(x, quantize(x, f"lm{bits}", granularity=PerGroup(64)).dequantize())
        uni = snr_db(x, quantize(x, f"int{bits}", granularity=PerGroup(64)).dequantize())
        assert lm > uni + 1.0, (bits, lm, uni)


def test_data_fit_beats_gaussian_on_non_gaussian_data():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(128, 128, generator=g) * 2 - 1  # uniform: Gaussian levels are wrong
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, x, x.sign() * x.abs().pow(0.3))
    for bits in (2, 3, 4):
        gauss = snr_db(x, quantize(x, f"lm{bits}", norm="rms").dequantize())
        data = snr_db(x, quantize(x, f"lm{bits}", norm="rms", fit="data").dequantize())
        assert data > gauss + 0.3, (bits, gauss, data)


def test_fit_codebook_reaches_a_lloyd_fixed_point():
    v = torch.randn(20000, generator=torch.Generator().manual_seed(5)).pow(3)
    c = fit_codebook(v, 3, max_iter=500, tol=0.0)
    idx = assign(v, c).long()
    for i in range(c.numel()):
        cell = v[idx == i]
        assert cell.numel() > 0
        assert c[i].item() == pytest.approx(cell.double().mean().item(), abs=1e-5)
    assert bool((c[1:] > c[:-1]).all())


def test_deterministic():
    x = torch.randn(32, 128)
    a, b = quantize(x, "lm3", fit="data"), quantize(x, "lm3", fit="data")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.extra["codebook"], b.extra["codebook"])


@pytest.mark.parametrize(("bits", "gran", "scale_dtype"), [
    (4, PerGroup(64), torch.float16), (2, PerGroup(32), torch.float16),
    (3, PerGroup(128), torch.float32), (4, PerToken(), torch.float16),
])
def test_honest_bytes(bits, gran, scale_dtype):
    x = torch.randn(64, 256)
    qt = quantize(x, f"lm{bits}", granularity=gran, scale_dtype=scale_dtype)
    n_groups = gran.n_groups(x.shape)
    expected = x.numel() * bits // 8 + n_groups * (2 if scale_dtype == torch.float16 else 4) + 4 * 2**bits
    assert qt.nbytes == expected
    assert qt.codes.dtype == torch.uint8 and qt.codes.numel() == x.numel() * bits // 8
    assert qt.bits_per_element == pytest.approx(8 * expected / x.numel())


def test_zero_groups_and_custom_codebook():
    x = torch.randn(4, 64)
    x[2] = 0
    for fit in ("gaussian", "data"):
        assert torch.equal(quantize(x, "lm2", fit=fit).dequantize()[2], torch.zeros(64))
    levels = torch.tensor([-2.0, -0.5, 0.5, 2.0])
    qt = quantize(x, "lm2", codebook=levels, norm="rms")
    assert torch.equal(qt.extra["codebook"], levels) and qt.fmt.variant == "lm2-custom"


def test_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bits=7 is not supported; allowed: 1, 2, 3, 4, 5, 6"):
        quantize_codebook(x, 7)
    with pytest.raises(ValueError, match="unknown format 'lm7'"):
        quantize(x, "lm7")
    with pytest.raises(ValueError, match="fit='kmeans'; allowed: gaussian, data"):
        quantize(x, "lm3", fit="kmeans")
    with pytest.raises(ValueError, match="norm='max'; allowed: best, absmax, rms"):
        quantize(x, "lm3", norm="max")
    with pytest.raises(ValueError, match=r"codebook must be a 1-D tensor of 2\*\*2 = 4 levels"):
        quantize(x, "lm2", codebook=torch.zeros(8))
    with pytest.raises(ValueError, match="finite and strictly increasing"):
        quantize(x, "lm2", codebook=torch.tensor([1.0, 0.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="not allowed for codebooks; allowed: PerTensor"):
        quantize(torch.randn(2, 256), "lm4", granularity=SuperBlock(256, 32))
    with pytest.raises(ValueError, match="group size 64 does not divide axis -1 of length 48"):
        quantize(torch.randn(2, 48), "lm4")


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_fit_codebook_matches_reference_loop(bits):
    from lessmem.formats._reference import fit_codebook_reference

    v = torch.randn(600, generator=torch.Generator().manual_seed(bits)).pow(3)
    init = gaussian_codebook(bits)
    for iters in (1, 2, 5):
        fast = fit_codebook(v, bits, max_iter=iters, tol=0.0)
        slow = torch.tensor(fit_codebook_reference(v, init, iters))
        assert torch.allclose(fast, slow, rtol=1e-6, atol=1e-7), (iters, fast, slow)
