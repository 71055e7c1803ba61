"""The cache's block codec and its layouts against the kernel's independent reference dequantizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lessmem.formats import PerGroup, PerToken
from lessmem.formats.codebook import gaussian_codebook
from lessmem.kernels.attention import QuantKV, QuantSide, quantized_attention
from lessmem.kernels.attention_reference import attention_reference, dequantize_side
from lessmem.kvcache import config as kvconfig
from lessmem.kvcache.codec import FORMATS, check_head_dim, encode, kv_layout
from lessmem.kvcache.config import KVTensorConfig
from lessmem.kvcache.layer import _side


def decode(enc, spec, head_dim):
    """The production dequantizer (the layout's, used by the torch fallback and the cache)."""
    return kv_layout(spec, head_dim).dequantize(enc.codes, enc.scale, enc.zero_point)

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
    lv = kv_layout(KVTensorConfig("lm", 2, PerToken()), 64).levels
    assert lv[2] == pytest.approx(0.4528, abs=2e-3) and lv[3] == pytest.approx(1.510, abs=2e-3)
    # one Lloyd-Max solver: the cache's "lm" levels are the formats codebook's
    for bits in (2, 3, 4):
        levels = kv_layout(KVTensorConfig("lm", bits, PerToken()), 64).levels
        assert levels == tuple(gaussian_codebook(bits).tolist())


def test_every_config_format_has_one_codec_entry():
    assert set(FORMATS) == set(kvconfig.FORMATS) - {"none"}
    for name, fmt in FORMATS.items():  # the config accepts exactly the bit widths the codec has
        accepted = []
        for bits in range(1, 9):
            try:
                KVTensorConfig(name, bits, PerToken())
                accepted.append(bits)
            except ValueError:
                pass
        assert tuple(accepted) == fmt.bits
        for bits in fmt.bits:  # and each of them has a layout at a usual head_dim
            assert kv_layout(KVTensorConfig(name, bits, PerToken()), 128).bits == bits
    with pytest.raises(ValueError, match="full precision and has no KV layout"):
        kv_layout(kvconfig.NONE, 64)


@pytest.mark.parametrize("spec", [KVTensorConfig("uint", 4, PerGroup(32, axis=-2)),
                                  KVTensorConfig("int", 2, PerToken()), KVTensorConfig("uint", 4, PerToken()),
                                  KVTensorConfig("lm", 4, PerGroup(16))],
                         ids=lambda s: f"{s.format}{s.bits}")
def test_a_new_layout_round_trips_encoder_reference_kernel(spec):
    # a layout the cache does not use (bit-stream rows instead of split rows), described once:
    # the encoder packs by it, the oracle and both kernel paths read it, nothing else changes
    own = kv_layout(spec, 64)
    new = dataclasses.replace(own, packing="stream")
    g = torch.Generator().manual_seed(spec.bits)
    x = torch.randn(2, 2, 64, 64, generator=g)
    e_own, e_new = encode(x, spec), encode(x, spec, layout=new)
    assert e_new.codes.shape == e_own.codes.shape and not torch.equal(e_new.codes, e_own.codes)
    s_own = QuantSide(e_own.codes, e_own.scale, e_own.zero_point, own)
    s_new = QuantSide(e_new.codes, e_new.scale, e_new.zero_point, new)
    ref = dequantize_side(s_new)
    assert torch.equal(ref, dequantize_side(s_own)) and torch.equal(s_new.dequantize(), ref)
    kv_own, kv_new = QuantKV(s_own, s_own), QuantKV(s_new, s_new)
    q = torch.randn(2, 4, 3, 64, generator=g) * 0.1
    want, _ = attention_reference(q, kv_new)
    for use_cpp in (True, False):
        out, _ = quantized_attention(q, kv_new, use_cpp=use_cpp)
        assert (out - want).abs().max() <= 1e-4 * float(want.abs().max()) + 1e-6
        assert torch.equal(out, quantized_attention(q, kv_own, use_cpp=use_cpp)[0])
    with pytest.raises(ValueError, match="does not store format"):
        encode(x, spec, layout=dataclasses.replace(own, token_group=own.token_group * 2))


def test_head_dim_must_fit():
    with pytest.raises(ValueError, match="head_dim=40 does not fit uint4 with channel group 32"):
        check_head_dim(KVTensorConfig("uint", 4, PerGroup(32)), 40)


@pytest.mark.parametrize("preset", ["int4", "kivi-2", "best-4", "best-3", "fp8"])
def test_kv_encode_op_is_codec_encode_and_traces(preset):
    from lessmem.kernels.ops import layout_id
    from lessmem.kvcache.codec import encode, kv_layout
    from lessmem.kvcache.encode_op import encode_chunk, spec_id
    from lessmem.kvcache.presets import resolve

    cfg = resolve(preset)
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(3))
    for spec in (cfg.keys, cfg.values):
        got, want = encode_chunk(x, spec), encode(x, spec)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
        assert (got.zero_point is None) == (want.zero_point is None)
        if want.zero_point is not None:
            assert torch.equal(got.zero_point, want.zero_point)
        args = (x, spec_id(spec), layout_id(kv_layout(spec, 64)))
        torch.library.opcheck(torch.ops.lessmem.kv_encode.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    with pytest.raises(ValueError, match="spec id 99999"):
        torch.ops.lessmem.kv_encode(x, 99999, 0)
