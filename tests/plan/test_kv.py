"""KV bytes: the fast arithmetic against the element-by-element reference, presets, specs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessmem.plan import KV_PRESETS, KVPrecision, get_kv, get_model, kv_bytes
from lessmem.plan._reference import kv_bytes_reference
from lessmem.plan.models import ModelDims

TINY = ModelDims("tiny", layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=100)


@settings(max_examples=60, deadline=None)
@given(
    context=st.integers(0, 40), batch=st.integers(1, 2),
    kb=st.sampled_from([2, 3, 4, 8, 16]), vb=st.sampled_from([2, 4, 8]),
    ktok=st.sampled_from([1, 4, 8]), kch=st.sampled_from([None, 1, 3, 4, 8]),
    vch=st.sampled_from([None, 2, 8]), scale=st.sampled_from([0.0, 2.0, 4.0]),
    zp=st.sampled_from([0.0, 0.5, 1.0]), window=st.integers(0, 9), sinks=st.integers(0, 3),
    block=st.sampled_from([1, 4, 8]), skip=st.integers(0, 2),
)
def test_kv_bytes_matches_reference(context, batch, kb, vb, ktok, kch, vch, scale, zp, window, sinks,
                                    block, skip):
    p = KVPrecision("x", kb, vb, ktok, kch, 1, vch, scale, scale, zp, zp, window, sinks, block,
                    skip_layers=skip)
    assert kv_bytes(TINY, context, batch, p)["total"] == kv_bytes_reference(TINY, context, batch, p)


@pytest.mark.parametrize("name", list(KV_PRESETS))
def test_presets_match_reference(name):
    p = get_kv(name)
    assert kv_bytes(TINY, 200, 1, p)["total"] == kv_bytes_reference(TINY, 200, 1, p)


def test_parts_add_up_and_fp16_equivalent():
    m = get_model("smollm2-135m")
    r = kv_bytes(m, 4096, 2, get_kv("kivi-4"))
    assert r["codes"] + r["scales"] + r["full"] == pytest.approx(r["total"], abs=3)
    assert r["fp16"] == 2 * 4096 * 2 * 30 * 3 * 64 * 2
    assert r["quantized_tokens"] + r["full_precision_tokens"] == 4096
    assert r["full_precision_tokens"] == 128  # kivi-4: window 128, no sinks
    # keys per-channel in groups of 32 tokens, fp16 scale + uint8 zero point: 4 + 24/32
    assert r["k_bits_effective"] == pytest.approx(4.75)
    assert 3.0 < r["fp16"] / r["total"] < 4.0


def test_window_and_sinks_stay_full_precision():
    m = get_model("llama-3-8b")
    p = get_kv("int4:window=128:sinks=4")
    r = kv_bytes(m, 100, 1, p)  # shorter than the window: nothing quantized
    assert r["quantized_tokens"] == 0 and r["total"] == 100 * 131072
    r = kv_bytes(m, 1132, 1, p)
    assert r["quantized_tokens"] == 1000
    assert r["total"] == 1000 * 32768 + 132 * 131072


def test_spec_options():
    p = get_kv("int4:g=32:zp=1:window=128:sinks=4:block=32:skip=2")
    assert (p.k_bits, p.k_group_channels, p.k_scale_bytes, p.k_zero_point_bytes) == (4, 32, 2.0, 1.0)
    assert (p.window, p.sinks, p.block, p.skip_layers) == (128, 4, 32, 2)
    assert get_kv("k8v4").k_bits == 8 and get_kv("k8v4").v_bits == 4
    assert get_kv("INT4").name == "int4"
    assert get_kv("lessmem:int8").window == 128


@pytest.mark.parametrize("spec,match", [
    ("fp7", "unknown KV precision 'fp7'; choose one of: fp32, fp16"),
    ("int4:g", "needs a value"),
    ("int4:bogus=3", "unknown KV option 'bogus'"),
    ("int4:window=1.5", "whole number"),
    ("int4:g=x", "is not a number"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        get_kv(spec)


def test_bad_precision_fields():
    with pytest.raises(ValueError, match=r"k_bits=0; allowed: 1 to 32 bits"):
        KVPrecision("x", 0, 4)
    with pytest.raises(ValueError, match=r"window=-1; allowed: an integer >= 0"):
        KVPrecision("x", 4, 4, window=-1)
    with pytest.raises(ValueError, match=r"quality='meh'"):
        KVPrecision("x", 4, 4, quality="meh")
    with pytest.raises(ValueError, match=r"context=-1 must be a non-negative integer"):
        kv_bytes(TINY, -1, 1, get_kv("fp16"))
    with pytest.raises(ValueError, match=r"skip_layers=5 exceeds the model's 3 layers"):
        kv_bytes(TINY, 1, 1, get_kv("int4:skip=5"))


def test_to_dict_round_trip():
    for p in (get_kv("kivi-2"), get_kv("int4:g=32:window=64")):
        assert KVPrecision.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match=r"unknown KVPrecision field\(s\) \['bits'\]; allowed"):
        KVPrecision.from_dict({"name": "x", "k_bits": 4, "v_bits": 4, "bits": 4})


def test_plan_reports_marginal_and_average_bytes_per_token():
    from lessmem.plan import plan

    r = plan("llama-3-8b", context=16384, kv="kivi-4")["kv"][0]
    # keys: 4 bits + (fp16 scale + uint8 zp) per 32 tokens; values: the same per 128 channels
    assert r["per_quantized_token"] == 65536 / 2 * (4 + 24 / 32 + 4 + 24 / 128) / 8
    assert r["per_token"] > r["per_quantized_token"]  # the fp16 window raises the average
