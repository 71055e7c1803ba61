"""IQ4_NL / IQ4_XS in the fused GGUF dequant-matmul (C++ and its torch fallback,
``gguf_linear_torch``) against the test oracle ``gguf_linear_reference`` and the numpy
decoders of ``formats.gguf_iquants``; GGUFLinear and ``torch.ops.lessmem.gguf_linear``."""

import numpy as np
import pytest
import torch
from _cases import gguf_rows as _raw

from lessmem.formats.gguf import GGUF_IQ_TYPES, dequantize_gguf, quantize_gguf
from lessmem.kernels import gguf_linear_cpp as kern
from lessmem.kernels import linear_ops
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref
from lessmem.weights.gguf_linear import GGUFLinear

TYPES = ["iq4_nl", "iq4_xs"]
OPS = torch.ops.lessmem


@pytest.fixture(params=["cpp", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(kern, "_mod", lambda: None)
    elif not kern.available():
        pytest.skip("no C++ compiler: only the torch fallback runs")
    return request.param


def _random_blocks(t, n, k, seed):
    """Random bytes for every field (all index and scale bits), finite fp16 ``d``; a
    subnormal and exact zeros among them, which must decode like the reference."""
    gt = GGUF_IQ_TYPES[t]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // gt.block_size, gt.type_size), dtype=np.uint8)
    v = rng.uniform(-2, 2, size=blocks.shape[0]).astype(np.float16)
    v[::7] = np.float16(6e-6)
    v[::11] = 0
    blocks[:, 0:2] = v.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def test_kernel_types():
    assert kern.KERNEL_TYPES[-2:] == ("iq4_nl", "iq4_xs") and len(kern.KERNEL_TYPES) == 12
    assert linear_ops.ggml_type(20).name == "iq4_nl" and linear_ops.ggml_type(23).name == "iq4_xs"


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_matches_reference(backend, t, m, with_bias):
    n, k = 37, 512  # odd N; two IQ4_XS super-blocks, 16 IQ4_NL blocks per row
    raw = _raw(t, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    b = torch.randn(n, generator=torch.Generator().manual_seed(m)) if with_bias else None
    y = kern.gguf_linear(x, raw, t, n, bias=b)
    ref = gguf_linear_ref(x, raw, t, n) + (b if with_bias else 0)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("t", TYPES)
def test_decoders_bit_identical(backend, t):
    n, k = 6, 512
    for raw in (_raw(t, n, k, seed=1), _random_blocks(t, n, k, seed=2)):
        ref = dequantize_gguf(raw, t, (n, k))
        dq = kern.gguf_dequantize(raw, t, n, k)
        assert dq.numpy().tobytes() == ref.numpy().tobytes()  # every bit, signs of zero too
        # the fused path on one-hot inputs returns each weight exactly
        assert torch.equal(kern.gguf_linear(torch.eye(k), raw, t, n).T, ref)


@pytest.mark.parametrize("t", TYPES)
def test_threaded_large_layer(t):
    """Over ~1M weights the rows are split across threads: same results."""
    n, k = 613, 2048
    raw = _raw(t, n, k, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        for m in (1, 9):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = gguf_linear_ref(x, raw, t, n)
            torch.testing.assert_close(kern.gguf_linear(x, raw, t, n), ref, rtol=1e-5,
                                       atol=1e-5 * ref.abs().max().item())
        assert torch.equal(kern.gguf_dequantize(raw, t, n, k), dequantize_gguf(raw, t, (n, k)))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gguf_linear_module(t, with_bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 45, bias=with_bias)  # odd out_features
    q = GGUFLinear.from_linear(lin, t.upper())
    assert q.gguf_type == t and q.qweight.dtype == torch.uint8
    w_hat = dequantize_gguf(quantize_gguf(lin.weight.detach(), t), t, (45, 512))
    assert torch.equal(q.dequantized_weight(), w_hat)
    bias = lin.bias.detach() if with_bias else None
    for m in (1, 5, 17):
        x = torch.randn(m, 512)
        y = q(x)
        ref = x.double() @ w_hat.double().T + (bias.double() if with_bias else 0)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        # close to the float layer: a 4-bit weight
        yf = lin(x).detach()
        assert ((y - yf).pow(2).mean().sqrt() / (yf - (bias if with_bias else 0)).pow(2).mean().sqrt()) < 0.1
        # the op itself (what GGUFLinear calls on CPU)
        yo = OPS.gguf_linear(x, q.qweight, GGUF_IQ_TYPES[t].ggml_id, 45, bias, False)
        torch.testing.assert_close(yo.double(), ref, rtol=1e-5, atol=1e-5)
        # int8_activations has no int8 path for IQ types: the float kernel runs
        assert torch.equal(OPS.gguf_linear(x, q.qweight, GGUF_IQ_TYPES[t].ggml_id, 45, bias, True), yo)
    assert torch.equal(OPS.gguf_dequantize(q.qweight, GGUF_IQ_TYPES[t].ggml_id, 45, 512), w_hat)
    assert q(torch.randn(2, 512).bfloat16()).dtype == torch.bfloat16


def test_op_refuses_unknown_type_and_bad_shapes():
    raw = _raw("iq4_xs", 4, 256, seed=0)
    with pytest.raises(ValueError, match="GGUF type 99"):
        OPS.gguf_linear(torch.randn(1, 256), raw, 99, 4, None, False)
    with pytest.raises(ValueError, match="GGUF type 99"):
        OPS.gguf_dequantize(raw, 99, 4, 256)
    if kern.available():  # the C++ argument check itself (the module registers the CPU kernel)
        with pytest.raises(ValueError, match=r"GGUF type 99 is not supported.*20 \(IQ4_NL\), 23 \(IQ4_XS\)"):
            kern._mod()  # registered
            torch.ops.lessmem.gguf_dequantize(raw, 99, 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        OPS.gguf_linear(torch.randn(1, 224), raw, 23, 4, None, False)
    with pytest.raises(ValueError, match="in_features=48 must be a positive multiple of the IQ4_NL block size 32"):
        kern.gguf_dequantize(_raw("iq4_nl", 4, 64, seed=0), "iq4_nl", 4, 48)
    with pytest.raises(ValueError, match="in_features=288 must be a positive multiple of the IQ4_XS block size 256"):
        GGUFLinear(288, 8, "iq4_xs")
