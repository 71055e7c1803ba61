"""IQ4_NL / IQ4_XS beyond what ``test_gguf_linear.py`` runs for every kernel type (its
``TYPES`` include them: fused vs the oracle, decoders bit for bit on random bytes, threads):
GGUFLinear close to the float layer, ``torch.ops.lessmem.gguf_linear`` with and without
int8 activations (no int8 path for IQ types), and the refusals."""

import pytest
import torch
from _cases import gguf_rows as _raw

from lessmem.formats.gguf import GGUF_IQ_TYPES, dequantize_gguf, quantize_gguf
from lessmem.kernels import gguf_linear_cpp as kern
from lessmem.kernels import linear_ops
from lessmem.weights.gguf_linear import GGUFLinear

TYPES = ["iq4_nl", "iq4_xs"]
OPS = torch.ops.lessmem


def test_kernel_types():
    assert kern.KERNEL_TYPES[-2:] == ("iq4_nl", "iq4_xs") and len(kern.KERNEL_TYPES) == 12
    assert linear_ops.ggml_type(20).name == "iq4_nl" and linear_ops.ggml_type(23).name == "iq4_xs"


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
