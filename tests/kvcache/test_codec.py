"""The cache's block codec against the kernel's independent reference dequantizer."""

from __future__ import annotations

import pytest
import torch

from lessmem.formats import PerGroup, PerToken
from lessmem.kernels.attention_reference import dequantize_side
from lessmem.kvcache.codec import check_head_dim, decode, encode, lloyd_max_levels
from lessmem.kvcache.config import KVTensorConfig
from lessmem.kvcache.layer import _side

SPECS = [
    KVTensorConfig("uint", 4, PerGroup(32, axis=-2)), KVTensorConfig("uint", 2, PerGroup(16, axis=-2)),
    KVTensorConfig("uint", 3, PerGroup(64, axis=-2)), KVTensorConfig("int", 4, PerToken()),
    KVTensorConfig("int", 8, PerToken()), KVTensorConfig("uint", 2, PerGroup(32)),
    KVTensorConfig("int", 3, PerGroup(16)), KVTensorConfig("fp8-e4m3", 8, PerToken()),
    KVTensorConfig("fp8-e5m2", 8, PerGroup(32)), KVTensorConfig("lm", 2, PerGroup(32, axis=-2)),
    KVTensorConfig("lm", 4, PerToken()),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}{s.bits}-{s.group_shape(64)}")
def test_codec_decode_equals_kernel_reference(spec):
    x = torch.randn(2, 3, 64, 64) * torch.linspace(0.1, 3, 64)  # channel-varying scale
    enc = encode(x, spec)
    a = decode(enc, spec, 64)
    b = dequantize_side(_side(spec, enc.codes, enc.scale, enc.zero_point, 64), 64)
    assert torch.equal(a, b)
    assert enc.codes.shape == (2, 3, 64, 64 * spec.bits // 8)
    rel = ((a - x).pow(2).mean() / x.pow(2).mean()).item()
    limit = 5e-3 if spec.format.startswith("fp8") else {2: 0.2, 3: 0.05, 4: 0.02, 8: 1e-4}[spec.bits]
    assert rel < limit


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_error_bounded_by_half_a_step(bits):
    spec = KVTensorConfig("uint", bits, PerGroup(32, axis=-2))
    x = torch.randn(1, 2, 64, 64)
    enc = encode(x, spec)
    step = enc.scale.float().repeat_interleave(32, dim=2)
    assert ((decode(enc, spec, 64) - x).abs() <= step / 2 + 1e-6).all()


def test_more_bits_less_error():
    x = torch.randn(1, 2, 64, 64)
    errs = [(decode(encode(x, s), s, 64) - x).pow(2).mean().item()
            for s in (KVTensorConfig("uint", b, PerToken()) for b in (2, 3, 4, 8))]
    assert errs == sorted(errs, reverse=True)


def test_lloyd_max_levels_are_the_known_ones():
    # Max (1960): 2-bit Gaussian levels ±0.4528, ±1.510
    lv = lloyd_max_levels(2)
    assert lv[2] == pytest.approx(0.4528, abs=2e-3) and lv[3] == pytest.approx(1.510, abs=2e-3)


def test_head_dim_must_fit():
    with pytest.raises(ValueError, match="head_dim=40 does not fit uint4 with channel group 32"):
        check_head_dim(KVTensorConfig("uint", 4, PerGroup(32)), 40)
