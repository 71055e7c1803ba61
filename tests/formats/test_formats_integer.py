"""Integer affine formats: lecture exercise 1, fast path vs reference twin, outliers, bits."""

from __future__ import annotations

import pytest
import torch

from lessmem.formats import (
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    SuperBlock,
    error_stats,
    quantize,
    snr_db,
)
from lessmem.formats._reference import quantize_int_reference, quantize_superblock_reference
from lessmem.formats.integer import _effective_qparams, grouped_codes


def test_lecture_exercise_1_exactly():
    k = torch.tensor([[1.20, -0.45, 3.80, -2.10]])
    qt = quantize(k, "int8", granularity=PerToken(), scale_dtype=torch.float32)
    assert qt.scale.dtype == torch.float32
    assert qt.scale.item() == pytest.approx(3.80 / 127, rel=1e-7)  # fp32 scale
    assert qt.scale.item() == pytest.approx(0.0299212598, abs=1e-9)
    assert qt.int_codes().tolist() == [[40, -15, 127, -70]]
    k_hat = qt.dequantize()
    expected = torch.tensor([[1.19685, -0.44882, 3.80000, -2.09449]])
    assert torch.allclose(k_hat, expected, atol=1e-4)
    stats = error_stats(k, k_hat)
    assert stats["max_abs_err"] == pytest.approx(0.0055, abs=1e-4)  # at -2.10
    assert stats["max_rel_err"] == pytest.approx(0.0026, abs=1e-4)  # 0.26%, also at -2.10
    assert (k - k_hat).abs().argmax().item() == 3


GRANS = [PerTensor(), PerChannel(0), PerChannel(1), PerToken(), PerGroup(16), PerGroup(8, axis=0)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", GRANS, ids=repr)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_fast_path_matches_reference_bit_exact(bits, symmetric, gran, scale_dtype):
    g = torch.Generator().manual_seed(bits * 7 + symmetric)
    x = torch.randn(16, 48, generator=g) * 3 + (0.0 if symmetric else 1.0)
    x[2, 5] = 40.0  # one outlier
    x[3] = 0.0  # an all-zero row: scale falls back to 1
    qt = quantize(x, f"{'int' if symmetric else 'uint'}{bits}", granularity=gran,
                  scale_dtype=scale_dtype)
    xg, _ = gran.group(x)
    codes, scales, zps = quantize_int_reference(xg, bits, symmetric, scale_dtype=scale_dtype)
    assert torch.equal(grouped_codes(qt).long(), codes)
    scale, zp = _effective_qparams(qt)
    assert torch.equal(scale.float(), scales)
    if not symmetric:
        assert torch.equal(zp.long(), zps)


@pytest.mark.parametrize("clip_ratio", [0.9, 0.5])
@pytest.mark.parametrize("symmetric", [True, False])
def test_clipping_matches_reference(clip_ratio, symmetric):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    qt = quantize(x, "int4" if symmetric else "uint4", granularity=PerGroup(32),
                  clip_ratio=clip_ratio)
    xg, _ = PerGroup(32).group(x)
    codes, scales, _ = quantize_int_reference(xg, 4, symmetric, clip_ratio=clip_ratio)
    assert torch.equal(grouped_codes(qt).long(), codes)
    assert torch.equal(_effective_qparams(qt)[0].float(), scales)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("sb", [SuperBlock(256, 16), SuperBlock(256, 32, sub_scale_bits=4)], ids=repr)
def test_superblock_matches_reference(bits, symmetric, sb):
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(bits)) * 2 + 0.5
    qt = quantize(x, f"{'int' if symmetric else 'uint'}{bits}", granularity=sb)
    xg, _ = sb.group(x)
    codes, eff, zps, sub_codes, d = quantize_superblock_reference(
        xg, bits, symmetric, sb.subs_per_block, sb.sub_scale_bits)
    assert torch.equal(grouped_codes(qt).long(), codes)
    scale, zp = _effective_qparams(qt)
    assert torch.equal(scale.float(), eff)
    assert torch.equal(qt.extra["super_scale"].float(), d)
    if not symmetric:
        assert torch.equal(zp.long(), zps)


def test_outlier_columns_group32_beats_per_tensor_by_10db():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=g)
    w[:, 100] *= 100.0
    w[:, 3000] *= 100.0
    per_tensor = snr_db(w, quantize(w, "int4", granularity=PerTensor()).dequantize())
    group32 = snr_db(w, quantize(w, "int4", granularity=PerGroup(32)).dequantize())
    assert group32 - per_tensor >= 10.0, (per_tensor, group32)


@pytest.mark.parametrize(("fmt", "gran", "scale_dtype", "bits"), [
    ("int4", PerGroup(32), torch.float16, 4.5),
    ("int4", PerGroup(32), torch.float32, 5.0),
    ("int8", PerGroup(32), torch.float16, 8.5),
    ("int3", PerGroup(32), torch.float16, 3.5),
    ("int2", PerGroup(64), torch.float16, 2.25),
    ("uint4", PerGroup(32), torch.float16, 4 + 16 / 32 + 4 / 32),  # 4-bit zero points, packed
    ("uint8", PerGroup(32), torch.float16, 8 + 16 / 32 + 8 / 32),
    ("int4", PerChannel(0), torch.float16, 4 + 16 / 256),
    ("int4", SuperBlock(256, 32), torch.float16, 4 + (8 * 6 + 16) / 256),
])
def test_honest_bits_per_element(fmt, gran, scale_dtype, bits):
    qt = quantize(torch.randn(64, 256), fmt, granularity=gran, scale_dtype=scale_dtype)
    assert qt.bits_per_element == pytest.approx(bits)
    assert qt.nbytes == sum(t.numel() * t.element_size() for t in qt.tensors())


def test_int8_per_tensor_is_about_8_bits_and_shape_dtype_roundtrip():
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    qt = quantize(x, "int8")
    assert qt.bits_per_element == pytest.approx(8 + 16 / x.numel())
    y = qt.dequantize()
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert qt.dequantize(torch.float32).dtype == torch.float32
