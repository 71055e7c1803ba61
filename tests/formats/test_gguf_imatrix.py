"""GGUF quantizers with an importance matrix (llama.cpp ``quantize_<type>(..., quant_weights)``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from _gguf_golden import golden_imatrix, golden_input

from lessmem.formats import quantize
from lessmem.formats.gguf import dequantize_gguf, quantize_gguf

KQ = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
WEIGHTED = ["q4_0", "q4_1", "q5_0", "q5_1", *KQ]  # Q8_0 has no weighted variant

# SHA-256 of llama.cpp's quantize_<type>(golden_input(), 8 rows, 1024, golden_imatrix())
# (vendored in llama-cpp-python 0.3.36, gcc -O2 -ffp-contract=off, x86-64)
LLAMA_CPP_IMATRIX_SHA256 = {
    "q4_0": "52259421e15cde5375b2b2530633fcf0e01027f1059a23e736c95488e0239838",
    "q4_1": "8158eb7cba1b5190dc795d48f138e8c1aa9e661dc78d8a09f2ba22fbb677d2b4",
    "q5_0": "0fbdda6b26c45817ac944486a39abd7e091ce45d9b6d1d6396a700c224afa302",
    "q5_1": "d55789748ba56eee561df0259c022ce596d59f805acc2b369c4b3687c66e1d39",
    "q2_k": "88335adbab11e70800439feefdb03f0be68610d1a3d71085d52240087714857d",
    "q3_k": "24bfefa811958d8a4a0c1536afc6cc9b87e4043289604b1581701051ec392a04",
    "q4_k": "5c5271e8cc24deaa934833cf936e3d5247e4b30e6c8353a104569a33eeef7b90",
    "q5_k": "3f832ad2b74f45b32e0ea2ac1761b57877aba530abae2a4b8ac2b874f195cfb7",
    "q6_k": "7a6708d0d8cdc4b822074cf7c6c5d0f9f19d615fd8170017940d54fa88b51dc2",
}


@pytest.mark.parametrize("name", WEIGHTED)
def test_imatrix_bytes_equal_llama_cpp(name):
    raw = quantize_gguf(torch.from_numpy(golden_input()), name, imatrix=golden_imatrix())
    assert hashlib.sha256(raw.tobytes()).hexdigest() == LLAMA_CPP_IMATRIX_SHA256[name]


@pytest.mark.parametrize("name", WEIGHTED)
def test_imatrix_lowers_the_weighted_error(name):
    # columns with large importance get reconstructed better than without the imatrix
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=g)
    imp = torch.rand(512, generator=g) ** 4 * 10  # a few columns matter much more
    plain = dequantize_gguf(quantize_gguf(x, name), name, x.shape)
    weighted = dequantize_gguf(quantize_gguf(x, name, imatrix=imp), name, x.shape)
    err_plain = float((imp * (x - plain) ** 2).sum())
    err_weighted = float((imp * (x - weighted) ** 2).sum())
    assert err_weighted < 0.9 * err_plain, (err_weighted, err_plain)  # measured 0.52-0.79


def test_imatrix_through_quantize_and_shapes():
    x = torch.randn(2, 3, 512)
    w = np.linspace(0.1, 2.0, 512, dtype=np.float32)
    qt = quantize(x, "Q4_K", imatrix=torch.from_numpy(w))
    assert qt.bits_per_element == 4.5
    assert np.array_equal(qt.codes.numpy().reshape(-1), quantize_gguf(x, "q4_k", imatrix=w).reshape(-1))
    # rows are independent and the imatrix repeats for every row
    by_row = np.concatenate([quantize_gguf(x.reshape(6, 512)[i:i + 1], "q4_k", imatrix=w) for i in range(6)])
    assert np.array_equal(by_row, quantize_gguf(x, "q4_k", imatrix=w).reshape(6, -1))


def test_q8_0_ignores_the_imatrix_like_llama_cpp():
    x = torch.randn(4, 256)
    assert np.array_equal(quantize_gguf(x, "q8_0", imatrix=np.linspace(0, 1, 256, dtype=np.float32)),
                          quantize_gguf(x, "q8_0"))


def test_imatrix_errors():
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match=r"one weight per column \(256\); got dtype float32 and shape \(128,\)"):
        quantize_gguf(x, "q4_k", imatrix=np.ones(128, np.float32))
    with pytest.raises(ValueError, match=r"got dtype int64"):
        quantize_gguf(x, "q6_k", imatrix=np.ones(256, np.int64))
    with pytest.raises(ValueError, match=r"finite, non-negative"):
        quantize_gguf(x, "q3_k", imatrix=-np.ones(256, np.float32))
    with pytest.raises(ValueError, match=r"finite, non-negative"):
        quantize_gguf(x, "q2_k", imatrix=np.full(256, np.nan, np.float32))
