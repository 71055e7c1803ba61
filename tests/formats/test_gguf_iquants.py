"""IQ4_NL / IQ4_XS: llama.cpp's bytes, gguf's decoder, error sanity and bad input."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch
from _gguf_golden import golden_imatrix, golden_input

from lessmem.formats import gguf_iquants as iq
from lessmem.formats import quantize
from lessmem.formats.gguf import (
    GGUF_IQ_TYPES,
    GGUF_TYPES,
    dequantize_gguf,
    gguf_type,
    quantize_gguf,
)

F32 = np.float32
IQ = ["iq4_nl", "iq4_xs"]
GG = {"iq4_nl": gguf.GGMLQuantizationType.IQ4_NL, "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS}

# SHA-256 of llama.cpp's quantize_iq4_nl / quantize_iq4_xs(golden_input(), dst, 8 rows, 1024,
# imatrix) with imatrix NULL and golden_imatrix(): ggml/src/ggml-quants.c as vendored in
# llama-cpp-python 0.3.36, built with gcc -O2 -ffp-contract=off -shared -fPIC (x86-64) and
# called through ctypes (the same build reproduces the Q4_0 / Q4_K hashes of
# test_gguf_kquants.py and test_gguf_imatrix.py).
LLAMA_CPP_SHA256 = {
    ("iq4_nl", False): "9a942401152e0099a7062d0d3e0b5c44e97ddd2a011ffe99585131c32b9a4df5",
    ("iq4_nl", True): "ad88b3ebaddd8b2732e7312bf9b53b4163b726b13922dba15e06d5e86322d8f0",
    ("iq4_xs", False): "39fca17c9827c83095e4b775228d3fc6b4af21be9318f01a21e3b58fbbc96e66",
    ("iq4_xs", True): "606cb383b7893469cdeba290e4fdafd6e223be96be46ebd381f0bf61083af514",
}


@pytest.mark.parametrize("name", IQ)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_bytes_equal_llama_cpp(name, weighted):
    raw = quantize_gguf(torch.from_numpy(golden_input()), name,
                        imatrix=golden_imatrix() if weighted else None)
    assert raw.shape == (8, 1024 // gguf_type(name).block_size * gguf_type(name).type_size)
    assert hashlib.sha256(raw.tobytes()).hexdigest() == LLAMA_CPP_SHA256[name, weighted]


def test_registry():
    nl, xs = gguf_type("IQ4_NL"), gguf_type("iq4_xs")
    assert (nl.ggml_id, nl.block_size, nl.type_size, nl.bits_per_weight) == (20, 32, 18, 4.5)
    assert (xs.ggml_id, xs.block_size, xs.type_size, xs.bits_per_weight) == (23, 256, 136, 4.25)
    assert gguf_type(20) is nl and gguf_type(gguf.GGMLQuantizationType.IQ4_XS) is xs
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL] == (32, 18)
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_XS] == (256, 136)
    # kept out of the list the kernels / loader / planner iterate over
    assert not set(GGUF_IQ_TYPES) & set(GGUF_TYPES) and len(GGUF_TYPES) == 10
    with pytest.raises(ValueError, match=r"not supported; allowed: Q4_0, .*Q6_K, IQ4_NL, IQ4_XS"):
        gguf_type("iq3_xxs")


def _bell(seed, rows=16, cols=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 7::131] *= 12.0  # outliers
    return x


@pytest.mark.parametrize("name", IQ)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_decoder_equals_gguf_package(name, weighted):
    x = _bell(1)
    w = torch.rand(1024, generator=torch.Generator().manual_seed(2)) ** 3 if weighted else None
    raw = quantize_gguf(x, name, imatrix=w)
    ours = dequantize_gguf(raw, name, x.shape).numpy()
    theirs = gguf.quants.dequantize(raw, GG[name])
    assert theirs.shape == ours.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("name", IQ)
def test_decoder_on_arbitrary_bytes_equals_gguf_package(name):
    t = gguf_type(name)
    raw = np.random.default_rng(5).integers(0, 256, (300, t.type_size), dtype=np.uint8)
    raw[:, 1] &= 0x7B  # finite fp16 d (exponent never all ones)
    ours = dequantize_gguf(raw, name, (300, t.block_size)).numpy()
    theirs = gguf.quants.dequantize(raw, GG[name]).reshape(ours.shape)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def _rel_rms(x, name):
    y = dequantize_gguf(quantize_gguf(x, name), name, x.shape)
    return float(((x - y) ** 2).mean().sqrt() / (x ** 2).mean().sqrt())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_error_beats_q4_0_on_gaussian_data(seed):
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(seed))
    e_q40, e_nl, e_xs = (_rel_rms(x, n) for n in ("q4_0", "iq4_nl", "iq4_xs"))
    # measured: Q4_0 0.086, IQ4_NL 0.076, IQ4_XS 0.077 (Q4_1 0.078, Q4_K 0.071)
    assert e_nl <= 0.92 * e_q40 and e_xs <= 0.92 * e_q40, (e_nl, e_xs, e_q40)


@pytest.mark.parametrize("name", IQ)
def test_special_blocks(name):
    x = np.zeros((2, 512), F32)
    x[1] = 0.75
    raw = quantize_gguf(x, name)
    y = dequantize_gguf(raw, name, x.shape).numpy()
    assert np.array_equal(y[0], x[0])  # zero blocks: index 8 (level 1) times d = 0
    assert np.abs(y[1] - 0.75).max() < 0.75 / 50
    assert (np.frombuffer(raw[0].tobytes(), np.uint8)[-16:] == 0x88).all()


def test_best_index_matches_c_rule():
    # best_index_int8: bracket lo <= a < hi, lower iff a - lo < hi - a in float32
    v = iq.KVALUES_IQ4NL.astype(F32)
    half = np.arange(-300, 300, dtype=F32) / F32(2)
    rng = np.random.default_rng(0)
    a = np.concatenate([half, rng.standard_normal(20000).astype(F32) * F32(60),
                        rng.standard_normal(1000).astype(F32) * F32(1e-3),
                        np.array([0, -0.0, 1e30, -1e30, 3e38], F32)])
    a = np.concatenate([a, np.nextafter(a, F32(np.inf)), np.nextafter(a, F32(-np.inf))])
    mu = np.clip(np.searchsorted(v, a, side="right"), 1, 15)
    want = np.where((a - v[mu - 1]) < (v[mu] - a), mu - 1, mu)
    want = np.where(a <= v[0], 0, np.where(a >= v[15], 15, want))
    assert np.array_equal(iq._best_index(a), want)


def test_imatrix_lowers_the_weighted_error():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=g)
    imp = torch.rand(512, generator=g) ** 4 * 10
    for name in IQ:
        plain = dequantize_gguf(quantize_gguf(x, name), name, x.shape)
        weighted = dequantize_gguf(quantize_gguf(x, name, imatrix=imp), name, x.shape)
        assert float((imp * (x - weighted) ** 2).sum()) < 0.9 * float((imp * (x - plain) ** 2).sum())


def test_through_quantize_qtensor():
    x = torch.randn(3, 512)
    qt = quantize(x, "IQ4_XS")
    assert qt.bits_per_element == 4.25 and tuple(qt.codes.shape) == (3, 272)
    assert np.array_equal(qt.codes.numpy(), quantize_gguf(x, "iq4_xs"))
    assert torch.equal(qt.dequantize(), dequantize_gguf(qt.codes, "iq4_xs", x.shape))
    qn = quantize(x, "iq4_nl", imatrix=torch.ones(512))
    assert qn.bits_per_element == 4.5 and tuple(qn.codes.shape) == (3, 288)


@pytest.mark.parametrize("name", IQ)
def test_bad_input_raises(name):
    bs = gguf_type(name).block_size
    with pytest.raises(ValueError, match=f"multiple of the {name.upper()} block size {bs}"):
        quantize_gguf(torch.randn(2, bs + 16), name)
    x = torch.randn(2, 256)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_gguf(x, name)
    with pytest.raises(ValueError, match="overflow the fp16 block scales"):
        quantize_gguf(torch.full((1, 256), 1e9), name)
    with pytest.raises(ValueError, match=r"one weight per column \(256\)"):
        quantize_gguf(torch.randn(1, 256), name, imatrix=np.ones(32, F32))
    with pytest.raises(ValueError, match="raw holds"):
        dequantize_gguf(np.zeros(10, np.uint8), name, (1, 256))
