"""GGUF block formats: API, byte sizes, cross-checks with the gguf package, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lessmem.formats import QTensor, quantize
from lessmem.formats.gguf import GGUF_TYPES, dequantize_gguf, gguf_type, quantize_gguf
from lessmem.formats.metrics import snr_db

gguf = pytest.importorskip("gguf")  # the hf extra; installed in CI

LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
ALL = list(GGUF_TYPES)
BPW = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5,
       "q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}


def _gtype(name):
    return getattr(gguf.GGMLQuantizationType, name.upper())


def _datasets():
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(16, 512, generator=g)
    out = torch.randn(16, 512, generator=g)
    out[:, 7] *= 100.0  # outlier column
    out[3, 300] = -250.0
    special = torch.randn(16, 512, generator=g)
    special[0] = 0.0  # zero row
    special[1] = 1.25  # constant rows
    special[2] = -3.0
    special[3, :256] = 0.0  # zero blocks beside normal ones
    special[4] = special[4].abs() + 0.5  # all positive
    special[5] = torch.round(special[5] * 2)  # many exact ties for rounding
    special[6] *= 1e-6  # tiny
    special[7, ::5] = 0.0
    return {"gauss": gauss, "outliers": out, "special": special}


DATA = _datasets()


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("data", list(DATA))
def test_legacy_quantize_bit_exact_with_gguf_package(name, data):
    x = DATA[data]
    ours = quantize_gguf(x, name)
    theirs = gguf.quants.quantize(x.numpy(), _gtype(name))
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("data", list(DATA))
def test_dequantize_bit_exact_with_gguf_package(name, data):
    x = DATA[data]
    raw = quantize_gguf(x, name)
    ours = dequantize_gguf(raw, name, x.shape).numpy()
    theirs = gguf.quants.dequantize(raw, _gtype(name))
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    # compare the bit patterns: equal floats *and* equal signs of zero
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("name", ALL)
def test_bytes_and_bits_per_weight(name):
    x = DATA["gauss"]
    t = GGUF_TYPES[name]
    qt = quantize(x, name.upper())
    assert isinstance(qt, QTensor)
    assert qt.fmt.kind == "gguf" and qt.fmt.variant == name
    assert qt.scale is None and qt.zero_point is None and not qt.extra
    assert qt.codes.dtype == torch.uint8
    assert tuple(qt.codes.shape) == (16, 512 // t.block_size * t.type_size)
    assert qt.nbytes == x.numel() // t.block_size * t.type_size
    assert qt.bits_per_element == BPW[name]
    assert t.bits_per_weight == BPW[name]
    assert gguf.GGML_QUANT_SIZES[_gtype(name)] == (t.block_size, t.type_size)
    assert t.ggml_id == int(_gtype(name))


@pytest.mark.parametrize("name", ALL)
def test_qtensor_dequantize_matches_raw_api(name):
    x = DATA["outliers"][:4]
    qt = quantize(x, name)
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, dequantize_gguf(quantize_gguf(x, name), name, x.shape))


@pytest.mark.parametrize("name", ALL)
def test_shapes_dtypes_and_inputs(name):
    t = GGUF_TYPES[name]
    x = torch.randn(2, 3, 2 * t.block_size)
    raw = quantize_gguf(x, name)
    assert raw.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, _gtype(name))
    y = dequantize_gguf(raw, name, x.shape)
    assert y.shape == x.shape
    # bytes, a flat uint8 tensor and a numpy input all give the same result
    assert torch.equal(dequantize_gguf(raw.tobytes(), name, x.shape), y)
    assert torch.equal(dequantize_gguf(torch.from_numpy(raw.reshape(-1)), name, x.shape), y)
    assert np.array_equal(quantize_gguf(x.numpy(), name), raw)
    # half-precision input is widened exactly to float32 first
    xh = x.to(torch.bfloat16)
    assert np.array_equal(quantize_gguf(xh, name), quantize_gguf(xh.float(), name))
    assert quantize(xh, name).dequantize().dtype == torch.bfloat16
    one_d = torch.randn(t.block_size)
    assert dequantize_gguf(quantize_gguf(one_d, name), name, one_d.shape).shape == one_d.shape


def test_type_lookup_by_name_id_and_enum():
    assert gguf_type("Q4_K") is GGUF_TYPES["q4_k"]
    assert gguf_type(12) is GGUF_TYPES["q4_k"]
    assert gguf_type(gguf.GGMLQuantizationType.Q6_K) is GGUF_TYPES["q6_k"]
    x = DATA["gauss"][:2]
    assert np.array_equal(quantize_gguf(x, gguf.GGMLQuantizationType.Q8_0), quantize_gguf(x, "q8_0"))


def test_q8_0_error_within_half_step():
    x = DATA["outliers"]
    y = dequantize_gguf(quantize_gguf(x, "q8_0"), "q8_0", x.shape)
    d = x.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
    err = (x.reshape(-1, 32) - y.reshape(-1, 32)).abs()
    # codes round to nearest; the stored fp16 d adds at most 127 * |d - fp16(d)|
    assert bool((err <= d / 2 + 127 * d * 2**-11 + 1e-7).all())


def test_zero_and_constant_rows():
    for name in ALL:
        zero = torch.zeros(2, 256)
        assert torch.equal(dequantize_gguf(quantize_gguf(zero, name), name, zero.shape), zero), name
        for v in (2.0, -0.5, 1.3, -7.77):
            x = torch.full((1, 256), v)
            y = dequantize_gguf(quantize_gguf(x, name), name, x.shape)
            # only the fp16 block scales limit a constant row
            assert float((y - x).abs().max()) <= 5e-4 * abs(v), (name, v)
            # power-of-two constants need no rounding where there is no 6-bit sub-scale
            if v in (2.0, -0.5) and name not in ("q8_0", "q2_k", "q4_k", "q5_k"):
                assert torch.equal(y, x), (name, v)


def test_snr_ordering_on_gaussian():
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(1))
    snr = {n: snr_db(x, dequantize_gguf(quantize_gguf(x, n), n, x.shape)) for n in ALL}
    k_order = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0"]
    assert all(snr[a] < snr[b] for a, b in zip(k_order[:-1], k_order[1:], strict=True)), snr
    assert snr["q4_0"] < snr["q4_1"] < snr["q5_0"] < snr["q5_1"] < snr["q8_0"], snr
    assert snr["q4_k"] > snr["q4_0"] + 1.0, snr
    # ballpark for N(0, 1) (measured 256x4096: q4_0 21.3, q4_k 22.9, q6_k 35.0 dB)
    assert 20.5 < snr["q4_0"] < 22.5 and 22.0 < snr["q4_k"] < 24.0 and 34.0 < snr["q6_k"] < 36.0, snr


# ---------------------------------------------------------------- errors

def test_last_dim_not_multiple_of_block_size():
    with pytest.raises(ValueError, match=r"shape \(4, 100\).*Q4_0 block size 32"):
        quantize_gguf(torch.randn(4, 100), "q4_0")
    with pytest.raises(ValueError, match=r"shape \(4, 512, 32\).*Q4_K block size 256"):
        quantize(torch.randn(4, 512, 32), "q4_k")
    with pytest.raises(ValueError, match=r"block size 256"):
        dequantize_gguf(np.zeros(144, np.uint8), "q4_k", (1, 128))


def test_unknown_type_names_allowed():
    with pytest.raises(ValueError, match=r"'q7_k' is not supported; allowed: Q4_0.*Q6_K"):
        quantize_gguf(torch.randn(2, 256), "q7_k")
    with pytest.raises(ValueError, match=r"99 is not supported"):
        gguf_type(99)
    with pytest.raises(ValueError, match=r"unknown format 'q4_z'"):
        quantize(torch.randn(2, 256), "q4_z")


def test_options_rejected():
    from lessmem.formats import PerGroup

    with pytest.raises(ValueError, match=r"Q4_K has a fixed layout and takes no options but imatrix; got granularity"):
        quantize(torch.randn(2, 256), "q4_k", granularity=PerGroup(32))


def test_bad_values_and_dtypes():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite.*1 NaN"):
        quantize_gguf(x, "q8_0")
    with pytest.raises(ValueError, match=r"dtype torch.int32.*floating"):
        quantize_gguf(torch.ones(2, 64, dtype=torch.int32), "q8_0")
    with pytest.raises(ValueError, match=r"dtype int64.*floating"):
        quantize_gguf(np.ones((2, 64), dtype=np.int64), "q4_0")
    with pytest.raises(ValueError, match=r"\|x\| = 1e\+07 overflow the fp16 block scales of Q4_0"):
        quantize_gguf(torch.full((1, 32), 1e7), "q4_0")


def test_raw_size_mismatch():
    raw = quantize_gguf(torch.randn(2, 256), "q6_k")
    with pytest.raises(ValueError, match=r"raw holds 420 bytes but shape \(4, 256\) in Q6_K needs 840"):
        dequantize_gguf(raw, "q6_k", (4, 256))
    with pytest.raises(ValueError, match=r"raw must be a numpy array, bytes or torch tensor, got list"):
        dequantize_gguf([0] * 420, "q6_k", (2, 256))


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q3_k"])
def test_blocks_are_independent_across_rows_and_chunks(name):
    # 66 x 1024 spans two 64K-element work chunks; each block only sees its own values
    x = torch.randn(66, 1024, generator=torch.Generator().manual_seed(5))
    whole = quantize_gguf(x, name)
    parts = np.concatenate([quantize_gguf(x[:5], name), quantize_gguf(x[5:], name)])
    assert np.array_equal(whole, parts)
    assert np.array_equal(whole[7:8], quantize_gguf(x[7:8], name))
