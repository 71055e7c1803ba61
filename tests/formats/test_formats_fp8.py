"""FP8 formats: real ranges, saturation, reference twin, scales, honest bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lessmem.formats import (
    FP8_FORMATS,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    SuperBlock,
    quantize,
    snr_db,
)
from lessmem.formats._reference import (
    FP8_LAYOUTS,
    fp8_cast_reference,
    fp8_decode_reference,
    quantize_fp8_reference,
)
from lessmem.formats.fp8 import fp8_spec, quantize_fp8

VARIANTS = list(FP8_FORMATS)


@pytest.mark.parametrize(("name", "fmax"), [("e4m3", 448.0), ("e4m3fn", 448.0), ("e4m3fnuz", 240.0),
                                            ("e5m2", 57344.0), ("e5m2fnuz", 57344.0)])
def test_real_ranges(name, fmax):
    spec = fp8_spec(name)
    assert spec.max == fmax
    assert torch.finfo(spec.dtype).max == fmax
    finite = [v for v in (fp8_decode_reference(b, spec.variant) for b in range(256))
              if v == v and abs(v) != float("inf")]
    assert max(finite) == fmax and min(finite) == -fmax
    assert min(v for v in finite if v > 0) == spec.min_subnormal
    assert torch.finfo(spec.dtype).tiny == spec.min_normal
    assert (spec.exp_bits, spec.man_bits, spec.bias) == FP8_LAYOUTS[spec.variant][:3]


def test_e4m3_alias_is_fn_not_fnuz():
    assert fp8_spec("e4m3") is FP8_FORMATS["e4m3fn"]
    assert quantize(torch.ones(4), "fp8-e4m3").fmt.variant == "e4m3fn"
    assert quantize(torch.ones(4), "FP8-E4M3FNUZ").fmt.variant == "e4m3fnuz"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_bit_pattern_decodes_like_torch(variant):
    dtype = FP8_FORMATS[variant].dtype
    torch_vals = torch.arange(256, dtype=torch.uint8).view(dtype).float().tolist()
    for b, tv in enumerate(torch_vals):
        rv = fp8_decode_reference(b, variant)
        assert (rv != rv and tv != tv) or rv == tv, (variant, b, rv, tv)


@pytest.mark.parametrize("variant", VARIANTS)
def test_saturation_not_nan(variant):
    fmax = FP8_FORMATS[variant].max
    x = torch.tensor([[1e6, -1e6, 3e38, -3e38, fmax * 1.01, 0.5, 0.0]])
    qt = quantize(x, f"fp8-{variant}", scaled=False)
    y = qt.dequantize()
    assert torch.isfinite(y).all()
    assert y[0, :5].tolist() == [fmax, -fmax, fmax, -fmax, fmax]
    assert y[0, 5].item() == 0.5 and y[0, 6].item() == 0.0
    assert qt.scale is None and qt.nbytes == x.numel()
    # scaled with clipping: the clipped tail saturates at ±fmax·s
    qt = quantize(torch.tensor([[1.0, -100.0, 2.0]]), f"fp8-{variant}", clip_ratio=0.5)
    assert qt.codes.float()[0, 1].item() == -fmax
    assert torch.isfinite(qt.dequantize()).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gran", [PerTensor(), PerToken(), PerChannel(1), PerGroup(16)], ids=repr)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_matches_reference(variant, gran, scale_dtype):
    g = torch.Generator().manual_seed(len(variant))
    x = torch.randn(6, 32, generator=g) * torch.logspace(-3, 2, 32)  # many binades
    x[1] = 0.0
    qt = quantize(x, f"fp8-{variant}", granularity=gran, scale_dtype=scale_dtype)
    xg, _ = gran.group(x)
    codes, scales = quantize_fp8_reference(xg, variant, scale_dtype)
    assert torch.equal(qt.scale.float(), scales)
    assert torch.equal(qt.codes.float(), codes)
    assert qt.codes.dtype == FP8_FORMATS[variant].dtype


@settings(max_examples=40, deadline=None)
@given(variant=st.sampled_from(VARIANTS),
       vals=st.lists(st.floats(-1e5, 1e5, allow_nan=False, width=32), min_size=1, max_size=30))
def test_cast_rounds_to_nearest_even_like_reference(variant, vals):
    x = torch.tensor([vals], dtype=torch.float32)
    qt = quantize_fp8(x, variant, scaled=False)
    assert qt.codes.float()[0].tolist() == fp8_cast_reference(vals, variant)


@settings(max_examples=30, deadline=None)
@given(variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       gran=st.sampled_from([PerTensor(), PerToken(), PerGroup(8)]))
def test_relative_error_bound(variant, seed, dtype, gran):
    """Normal-range values: |x - x̂| <= 2^-(m+1)·|x| (half an ulp), plus half a subnormal step."""
    spec = FP8_FORMATS[variant]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    qt = quantize(x, f"fp8-{variant}", granularity=gran)
    xg, _ = gran.group(x.float())
    yg, _ = gran.group(qt.dequantize(torch.float32))
    s = qt.scale.float().unsqueeze(1)
    bound = 2.0 ** -(spec.man_bits + 1) * xg.abs() * (1 + 1e-6) + s * spec.min_subnormal / 2 * (1 + 1e-6)
    assert bool(((xg - yg).abs() <= bound).all())


def test_e4m3_more_precise_than_e5m2_on_gaussian():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    e4 = snr_db(x, quantize(x, "fp8-e4m3", granularity=PerToken()).dequantize())
    e5 = snr_db(x, quantize(x, "fp8-e5m2", granularity=PerToken()).dequantize())
    assert e4 > e5 + 4.0  # one more mantissa bit ≈ 6 dB
    assert e4 > 28.0


@pytest.mark.parametrize(("gran", "scale_dtype", "bits"), [
    (PerTensor(), torch.float32, 8 + 32 / (64 * 256)),
    (PerTensor(), torch.float16, 8 + 16 / (64 * 256)),
    (PerToken(), torch.float32, 8 + 32 / 256),
    (PerGroup(32), torch.float16, 8.5),
    (PerGroup(128), torch.float32, 8.25),
])
def test_honest_bits(gran, scale_dtype, bits):
    qt = quantize(torch.randn(64, 256), "fp8-e4m3", granularity=gran, scale_dtype=scale_dtype)
    assert qt.bits_per_element == pytest.approx(bits)
    assert qt.codes.element_size() == 1 and qt.codes.numel() == 64 * 256
    assert round(quantize(torch.randn(64, 256), "fp8-e5m2").bits_per_element, 2) == 8.0


def test_shape_dtype_and_zero_groups():
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    x[1] = 0
    qt = quantize(x, "fp8-e4m3", granularity=PerChannel(1))
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y[1], torch.zeros(5, 8, dtype=torch.bfloat16))
    assert qt.fmt.name == "fp8-e4m3fn"


def test_errors():
    with pytest.raises(ValueError, match="fp8 variant='e3m4'; allowed: e4m3, e4m3fn, e4m3fnuz, e5m2"):
        quantize_fp8(torch.ones(4), "e3m4")
    with pytest.raises(ValueError, match="granularity=SuperBlock.* is not allowed for fp8; allowed: PerTensor"):
        quantize(torch.ones(2, 256), "fp8-e4m3", granularity=SuperBlock(256, 32))
    with pytest.raises(ValueError, match="scaled='yes' must be True or False"):
        quantize(torch.ones(4), "fp8-e5m2", scaled="yes")
    with pytest.raises(ValueError, match="unknown format 'fp8-e4m2'"):
        quantize(torch.ones(4), "fp8-e4m2")


@pytest.mark.parametrize("variant", VARIANTS)
def test_table_decode_equals_torch_cast(variant):
    from lessmem.formats.fp8 import _to_float

    c = torch.arange(256, dtype=torch.uint8).view(FP8_FORMATS[variant].dtype).reshape(16, 16)
    a, b = _to_float(c), c.float()
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a[~a.isnan()], b[~b.isnan()])
    assert torch.equal(a.signbit(), b.signbit())  # -0 stays -0
