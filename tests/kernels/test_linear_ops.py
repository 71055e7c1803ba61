"""torch.ops.lessmem's dequant-matmuls (kernels/linear_ops.py): the CPU backend is the C++
kernel bit for bit, the fallback backend the torch twin, fake kernels let torch.compile
trace a quantized layer, bad arguments are refused by name, and QuantLinear's CPU-only
int4pack layout becomes the portable one when the layer leaves the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from lessmem.formats.gguf import gguf_type, quantize_gguf
from lessmem.formats.packing import pack_bits
from lessmem.kernels import gguf_linear_cpp, linear_cpp, linear_ops
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref
from lessmem.kernels.linear_reference import lowbit_linear_ref
from lessmem.weights.gguf_linear import GGUFLinear
from lessmem.weights.qlinear import QuantLinear

OPS = torch.ops.lessmem


def _lowbit(bits=4, n=24, k=128, gs=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // gs, generator=g) * 0.05 + 0.01).half()
    zero = torch.randint(0, 2**bits, (n, k // gs), dtype=torch.uint8, generator=g)
    return pack_bits(u, bits), scale, zero, torch.randn(n, generator=g)


def _gguf(qtype="q4_k", n=16, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.from_numpy(quantize_gguf(torch.randn(n, k, generator=g), qtype)).view(n, -1)
    return raw, gguf_type(qtype)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lowbit_op_on_cpu_is_the_cpp_kernel(bits):
    codes, scale, zero, bias = _lowbit(bits)
    x = torch.randn(3, 128)
    got = OPS.lowbit_linear(x, codes, bits, scale, zero, 32, bias)
    assert torch.equal(got, linear_cpp.lowbit_linear(x, codes, bits, scale, zero, 32, bias))
    ref = lowbit_linear_ref(x, codes, bits, scale, zero, 32) + bias
    torch.testing.assert_close(got, ref.float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "q6_k", "q3_k"])
@pytest.mark.parametrize("int8_act", [False, True])
def test_gguf_op_on_cpu_is_the_cpp_kernel(qtype, int8_act):
    raw, t = _gguf(qtype)
    x = torch.randn(2, 256)
    got = OPS.gguf_linear(x, raw, t.ggml_id, 16, None, int8_act)
    if int8_act and qtype in gguf_linear_cpp.Q8_TYPES:
        want = gguf_linear_cpp.gguf_linear_q8(x, raw, t, 16)
    else:
        want = gguf_linear_cpp.gguf_linear(x, raw, t, 16)
    assert torch.equal(got, want)
    w = OPS.gguf_dequantize(raw, t.ggml_id, 16, 256)
    assert torch.equal(w, gguf_linear_cpp.gguf_dequantize(raw, t, 16, 256))


def test_fallback_backends_compute_the_same_and_warn_once():
    codes, scale, zero, bias = _lowbit(3)
    x = torch.randn(2, 128)
    linear_ops._warned.clear()
    with pytest.warns(RuntimeWarning, match="no lowbit_linear kernel for cpu tensors"):
        got = linear_ops._lowbit_fallback(x, codes, 3, scale, zero, 32, bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is quiet
        linear_ops._lowbit_fallback(x, codes, 3, scale, zero, 32, bias)
    torch.testing.assert_close(got, OPS.lowbit_linear(x, codes, 3, scale, zero, 32, bias), atol=1e-4, rtol=1e-4)
    raw, t = _gguf("q6_k")
    with pytest.warns(RuntimeWarning, match="q6_k gguf_linear"):
        got = linear_ops._gguf_fallback(x.repeat(1, 2), raw, t.ggml_id, 16, None, False)
    torch.testing.assert_close(got, gguf_linear_ref(x.repeat(1, 2), raw, t, 16), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["lowbit_linear", "int8_linear", "w8a8_linear", "gguf_linear"])
def test_opcheck(name):
    codes, scale, zero, bias = _lowbit(4)
    raw, t = _gguf("q4_0", k=128)
    w = torch.randint(-127, 128, (16, 128), dtype=torch.int8)
    s = (torch.rand(16) / 100 + 1e-3).half()
    args = {"lowbit_linear": (torch.randn(2, 128), codes, 4, scale, zero, 32, bias),
            "int8_linear": (torch.randn(2, 128), w, s),
            "w8a8_linear": (torch.randint(-127, 128, (2, 128), dtype=torch.int8), torch.rand(2), w, s),
            "gguf_linear": (torch.randn(2, 128), raw, t.ggml_id, 16, None, True)}[name]
    torch.library.opcheck(getattr(OPS, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_torch_compile_traces_quantized_layers_as_ops():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 32)
    layers = torch.nn.Sequential(QuantLinear.from_linear(lin, bits=3, group_size=64),
                                 torch.nn.ReLU(), GGUFLinear.from_linear(torch.nn.Linear(32, 8), "q8_0"))
    x = torch.randn(2, 256)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(layers, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, layers(x))
    called = {n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert OPS.lowbit_linear.default in called and OPS.gguf_linear.default in called, called


def test_bad_arguments_are_refused_by_name():
    codes, scale, zero, bias = _lowbit(4)
    raw, t = _gguf("q4_k")
    w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s = torch.rand(16).half()
    cases = [
        (lambda: OPS.lowbit_linear(torch.randn(1, 96), codes, 4, scale, zero, 32, None), "in_features"),
        (lambda: OPS.lowbit_linear(torch.randn(1, 128), codes[:-1], 4, scale, zero, 32, None), "codes hold"),
        (lambda: OPS.lowbit_linear(torch.randn(1, 128), codes, 5, scale, zero, 32, None), "bits=5"),
        (lambda: OPS.lowbit_linear(torch.randn(1, 128), codes, 4, scale.float(), zero, 32, None), "scale dtype"),
        (lambda: OPS.lowbit_linear(torch.randn(1, 128), codes, 4, scale, zero, 32, bias[:3]), "bias"),
        (lambda: OPS.int8_linear(torch.randn(1, 60), w, s), "60 input features"),
        (lambda: OPS.int8_linear(torch.randn(1, 64), w.float(), s), "w dtype"),
        (lambda: OPS.int8_linear(torch.randn(1, 64), w, s[:3]), "one per output row"),
        (lambda: OPS.w8a8_linear(torch.zeros(2, 60, dtype=torch.int8), torch.ones(2), w, s), "allowed: [M, K]"),
        (lambda: OPS.gguf_linear(torch.randn(1, 200), raw, t.ggml_id, 16, None, False), "multiple of 256"),
        (lambda: OPS.gguf_linear(torch.randn(1, 256), raw, t.ggml_id, 15, None, False), "bytes"),
        (lambda: OPS.gguf_linear(torch.randn(1, 256), raw, 99, 16, None, False), "GGUF type 99"),
        (lambda: OPS.gguf_linear(torch.randn(1, 256).int(), raw, t.ggml_id, 16, None, False), "float dtype"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            call()


def test_int4pack_layer_leaves_the_cpu_in_the_portable_layout():
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 64)
    q = QuantLinear.from_linear(lin, bits=4, group_size=32)
    if q.layout != "int4pack":
        pytest.skip("torch has no CPU int4pack op here")
    codes, scales, zero = q.codes(), q.scales(), q.zero()
    x = torch.randn(3, 128)
    y_int4pack = q(x)
    moved = QuantLinear.from_linear(lin, bits=4, group_size=32).to("meta")  # any device but the CPU
    assert moved.layout == "packed" and moved.qweight.device.type == "meta"
    # the same weights, held portably: equal codes, scales and zero points; outputs agree
    # up to the int4pack op's bf16 activations
    q._set_codes(codes, scales, zero, portable=True)
    assert q.layout == "packed"
    assert torch.equal(q.codes(), codes) and torch.equal(q.scales(), scales) and torch.equal(q.zero(), zero)
    torch.testing.assert_close(q(x), y_int4pack, atol=0.05, rtol=0.02)
