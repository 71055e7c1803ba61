"""torch.ops.lessmem.quantized_attention: its CPU backend, its fake kernel under torch.compile and opcheck."""

from __future__ import annotations

import pytest
import torch
from test_attention import _segments, _side

from lessmem.kernels import ops
from lessmem.kernels.attention import QuantKV, quantized_attention
from lessmem.kernels.attention_reference import attention_reference


def _case(seed=0, T=96):
    g = torch.Generator().manual_seed(seed)
    kv = QuantKV(_side(g, 2, 2, T, 64, 4, 32, 1, "zp"), _side(g, 2, 2, T, 64, 2, 1, 32, "zp"))
    q = torch.randn(2, 4, 1, 64, generator=g) * 0.3
    mask = torch.zeros(2, 1, T)
    mask[1, :, :20] = float("-inf")
    return q, kv, mask


def test_op_on_cpu_is_the_cpu_path_bit_for_bit():
    q, kv, mask = _case()
    out, lse = ops.quantized_attention_op(q, kv, mask)
    ref, ref_lse = quantized_attention(q, kv, mask)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    segs = _segments(kv, [0, 32, 64, 96], 32)
    out_s, lse_s = ops.quantized_attention_op(q, segs, mask)
    torch.testing.assert_close(out_s, attention_reference(q, kv, mask)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_s, ref_lse, atol=1e-5, rtol=1e-5)


def test_opcheck_on_cpu_tensors():
    q, kv, mask = _case(1)
    torch.library.opcheck(torch.ops.lessmem.quantized_attention.default, ops.op_args(q, kv, mask),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_torch_compile_traces_through_the_op():
    q, kv, mask = _case(2)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x):
        out, lse = quantized_attention(x * 1.0, kv, mask)
        return out.sum(-1) + lse

    got = torch.compile(step, backend=backend, fullgraph=False)(q)
    out, lse = quantized_attention(q, kv, mask)
    torch.testing.assert_close(got, out.sum(-1) + lse)
    called = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    op = torch.ops.lessmem.quantized_attention
    assert op in called or op.default in called, called  # traced as the op (its fake kernel), not broken


def test_bad_op_arguments_are_refused_by_name():
    q, kv, mask = _case(3)
    args = list(ops.op_args(q, kv, mask))
    args[5] = 10**6  # k_layout
    with pytest.raises(ValueError, match="layout id 1000000; allowed: an id from lessmem.kernels.ops.layout_id"):
        torch.ops.lessmem.quantized_attention(*args)
    args = list(ops.op_args(q, kv, mask))
    args[11] = torch.zeros(2, 1, 95)
    with pytest.raises(ValueError, match=r"mask must be \[B, Tq, T\] = \(2, 1, 96\), got \(2, 1, 95\)"):
        torch.ops.lessmem.quantized_attention(*args)
    args = list(ops.op_args(q, kv, mask))
    args[2] = []  # no key scales
    with pytest.raises(ValueError, match="1 code, 0 scale and 1 zero-point parts"):
        torch.ops.lessmem.quantized_attention(*args)
