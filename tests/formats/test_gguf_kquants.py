"""GGUF quantizers against their slow twins, against llama.cpp's bytes, and search properties."""

from __future__ import annotations

import ctypes
import hashlib
import os

import numpy as np
import pytest
import torch
from _gguf_golden import golden_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessmem.formats import gguf_search as kq
from lessmem.formats._gguf_reference import REFERENCE_QUANTIZERS
from lessmem.formats.gguf import GGUF_TYPES, dequantize_gguf, quantize_gguf

F32 = np.float32


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 512, generator=g)
    out = torch.randn(4, 512, generator=g)
    out[:, 11] *= 80.0
    special = torch.randn(4, 512, generator=g)
    special[0] = 0.0
    special[1] = 0.75
    special[2, :256] = 0.0
    special[3] = special[3].abs() + 0.25
    return {"gauss": x, "outliers": out, "special": special}


INPUTS = _inputs()


@pytest.mark.parametrize("name", sorted(REFERENCE_QUANTIZERS))
@pytest.mark.parametrize("data", list(INPUTS))
def test_fast_path_bit_exact_with_reference_twin(name, data):
    x = INPUTS[data]
    slow = b"".join(REFERENCE_QUANTIZERS[name](row) for row in x.numpy())
    fast = quantize_gguf(x, name)
    assert fast.tobytes() == slow


# SHA-256 of llama.cpp's quantize_row_<type>_ref output on ``golden_input()``: ggml-quants.c
# as vendored in llama-cpp-python 0.3.36, built with gcc -O2 -ffp-contract=off (x86-64).
LLAMA_CPP_SHA256 = {
    "q4_0": "347e7be709da0ee2230c4940347ff679753ebca9d45f5c38f19ca002c099a212",
    "q4_1": "7c14ac36dd74c72e97063a5ad6c1d24ca5f43b6ee29307cb8849a426c57f427b",
    "q5_0": "13edbe34403245d8b6901d7fd1b6bf6bc5ca1b04c8a77e915ad6e2e266f06f12",
    "q5_1": "6c4a36d3c52e0c26f2553884f3d4addec9b61a61d6a93435e4c5fffa0e118116",
    "q8_0": "ccb2aa65cb8360a196181bc79af20c83f94f37c8c01c08a93c48b408f917bf52",
    "q2_k": "d71d6b397bd982ea9849ff619a58978882d93d8811bc3d984533c75e832cacd8",
    "q3_k": "e6aa391740cb61aa67e33ba6e7bc4b97dc950df096560f1e9b8fff0249ca7835",
    "q4_k": "40f15c0de34d92dade79c3d3ea3b04ddf0b78bfb98347c5ea4cbd54280203f89",
    "q5_k": "5195bd7012fac2a9a748dd2e252683e71514f8f4cc3dca891f3b659e77eb4989",
    "q6_k": "e1b3bbdff680c1ab675159bfe3a9f1f983972fa076829fd3040900b534710b8a",
}


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_bytes_equal_llama_cpp_reference_quantizer(name):
    x = golden_input()
    raw = quantize_gguf(torch.from_numpy(x), name)
    assert hashlib.sha256(raw.tobytes()).hexdigest() == LLAMA_CPP_SHA256[name]


def _ggml_lib():
    path = os.environ.get("LESSMEM_GGML_QUANTS_LIB")
    if not path:
        pytest.skip("set LESSMEM_GGML_QUANTS_LIB to a shared library built from llama.cpp's "
                    "ggml/src/ggml-quants.c (gcc -O2 -shared -fPIC -ffp-contract=off) for a live check")
    return ctypes.CDLL(path, mode=getattr(os, "RTLD_LAZY", 1))


def test_bytes_equal_live_llama_cpp_build():
    """Opt-in: fresh random data against a locally built llama.cpp quantizer, every type.

    The library also needs a stub ``size_t ggml_row_size(int type, int64_t ne)`` (bytes of
    ``ne`` values of a type) for the imatrix entry points ``quantize_<type>``.
    """
    lib = _ggml_lib()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 1024)).astype(F32)
    x[:, 3] *= 50
    x[5] = 0
    x[6] = 1.5
    for name, t in GGUF_TYPES.items():
        out = np.zeros(x.size // t.block_size * t.type_size, np.uint8)
        fn = getattr(lib, f"quantize_row_{name.replace('_k', '_K')}_ref")
        fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
        assert np.array_equal(quantize_gguf(torch.from_numpy(x), name).reshape(-1), out), name
        if name != "q8_0":  # with an importance matrix: quantize_<type>(..., quant_weights)
            qw = rng.uniform(0, 2, x.shape[1]).astype(F32)
            fn = getattr(lib, f"quantize_{name.replace('_k', '_K')}")
            fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
               ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), qw.ctypes.data_as(ctypes.c_void_p))
            ours = quantize_gguf(torch.from_numpy(x), name, imatrix=qw).reshape(-1)
            assert np.array_equal(ours, out), f"{name} imatrix"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-3, 3), zero_frac=st.sampled_from([0.0, 0.3, 0.9]),
       name=st.sampled_from(["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]))
def test_kquant_dequantize_bit_exact_with_gguf_property(seed, log_scale, zero_frac, name):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 512, generator=g) * 10.0**log_scale
    x[torch.rand(2, 512, generator=g) < zero_frac] = 0.0
    raw = quantize_gguf(x, name)
    ours = dequantize_gguf(raw, name, x.shape).numpy()
    theirs = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name.upper()))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # and a sensible reconstruction (worst relative squared error seen over 540 draws:
    # q2_k 0.42 on 90%-zero data, q3_k 0.026, q4_k 0.0059, q5_k 0.0046, q6_k 0.0013)
    bound = {"q2_k": 0.6, "q3_k": 0.06, "q4_k": 0.015, "q5_k": 0.012, "q6_k": 0.004}[name]
    err = float(((x - torch.from_numpy(ours)) ** 2).sum())
    assert err <= bound * float((x**2).sum())


def _weighted_error(x, w, scale, neg_min, L):
    diff = scale[:, None] * L.astype(F32) - neg_min[:, None] - x
    return (w * diff * diff).sum(axis=1)


def test_make_qkx2_never_worse_than_min_max_rounding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype(F32)
    w = np.abs(x) + F32(0.5)
    scale, neg_min, L = kq.make_qkx2(x, w, 15, -1.0, 0.1, 20, False)
    assert L.min() >= 0 and L.max() <= 15 and (neg_min >= 0).all()
    lo = np.minimum(x.min(1), 0)
    s0 = (x.max(1) - lo) / 15
    L0 = np.clip(np.rint((x - lo[:, None]) / s0[:, None]), 0, 15)
    searched, plain = _weighted_error(x, w, scale, neg_min, L), _weighted_error(x, w, s0, -lo, L0)
    assert (searched <= plain * (1 + 1e-5)).all()
    assert searched.mean() < 0.9 * plain.mean()  # the search is worth its time


@pytest.mark.parametrize("search", ["q3", "qx"])
def test_symmetric_searches_improve_the_least_squares_fit(search):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, 16)).astype(F32)
    nmax = 4 if search == "q3" else 32
    scale, L = kq.make_q3(x, nmax) if search == "q3" else kq.make_qx(x, nmax)
    q = L.astype(F32) - nmax
    assert q.min() >= -nmax and q.max() <= nmax - 1
    # returned scale is the weighted least-squares fit of x to the codes (w = x^2)
    w = x * x
    np.testing.assert_allclose(scale, (w * x * q).sum(1) / (w * q * q).sum(1), rtol=1e-5)
    # and the codes fit better than rounding at the initial scale max / -nmax
    mx = x[np.arange(512), np.abs(x).argmax(1)]
    q0 = np.clip(np.rint(x * (-nmax / mx)[:, None]), -nmax, nmax - 1)

    def fit(qq):
        return (w * x * qq).sum(1) ** 2 / (w * qq * qq).sum(1)

    assert (fit(q) >= fit(q0) * (1 - 1e-5)).all()
    assert (fit(q) > fit(q0) * (1 + 1e-6)).mean() > 0.1  # measured: q3 0.17, qx 0.53


def test_nearest_int_matches_ggml_trick_and_rint():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49999, -7.5, 4194303.0, 12.0], dtype=F32)
    assert kq._rint(v).tolist() == [0, 2, 2, 0, -2, 3, -8, 4194303, 12]
    r = np.random.default_rng(2).uniform(-1000, 1000, 10000).astype(F32)
    assert np.array_equal(kq._rint(r), np.rint(r).astype(np.int32))
