"""QuantLinear: every layout against the dequantize-then-matmul reference; codes round-trip."""

import pytest
import torch

import lessmem
from lessmem.models import tiny_random
from lessmem.weights.qlinear import QuantLinear
from lessmem.weights.rtn import rtn_quantize


@pytest.mark.parametrize("bits,gs,sym,layout", [
    (2, 32, False, "packed"), (3, 64, True, "packed"), (4, 64, False, "int4pack"),
    (4, 32, True, "int4pack"), (8, None, True, "int8"),
    # 8-bit with zero points or groups: the int8 kernel takes neither (it once dropped the
    # zero points silently and crashed on per-group scales); held as bytes, dequantized
    (8, None, False, "packed"), (8, 32, True, "packed"),
])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_forward_matches_dequantized(bits, gs, sym, layout, rows):
    torch.manual_seed(bits + rows)
    lin = torch.nn.Linear(128, 48)
    q = QuantLinear.from_linear(lin, bits, gs, sym)
    assert q.layout == layout
    x = torch.randn(rows, 128)
    expect = x @ q.dequantized_weight().T + lin.bias
    # int4pack rounds activations to bf16 (relative 2^-9), the others are float32
    tol = 3e-2 if layout == "int4pack" else 1e-4
    torch.testing.assert_close(q(x), expect, rtol=tol, atol=tol)


def test_codes_and_dequantized_weight_match_rtn():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    for bits, gs, sym in [(2, 32, False), (3, 32, True), (4, 64, False), (8, 128, True)]:
        qw = rtn_quantize(w, bits, gs, sym)
        q = QuantLinear.from_quantized(qw)
        assert torch.equal(q.codes(), qw.codes)
        if q.layout != "int4pack":
            torch.testing.assert_close(q.dequantized_weight(), qw.dequantize())


def test_w8a8_close_to_float():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64)
    q = QuantLinear.from_linear(lin, 8, None, True, act_bits=8)
    x = torch.randn(2, 256)
    rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.02
    # fused (few rows) and BLAS (many rows) paths agree
    xb = torch.randn(40, 256)
    torch.testing.assert_close(q(xb[:3]), q(xb)[:3], rtol=1e-5, atol=1e-5)


def test_w8a8_needs_symmetric_per_row_codes():
    lin = torch.nn.Linear(256, 64)
    for gs, sym in ((64, True), (None, False)):
        with pytest.raises(ValueError, match=r"act_bits=8 \(W8A8\) needs 8-bit codes symmetric"):
            QuantLinear.from_linear(lin, 8, gs, sym, act_bits=8)


def test_rtn_error_bound_and_bits():
    torch.manual_seed(0)
    w = torch.randn(16, 256)
    for bits in (2, 3, 4):
        qw = rtn_quantize(w, bits, 64, False)
        step = qw.scale.float().repeat_interleave(64, 1)
        assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-5).all()
    q = QuantLinear.from_linear(torch.nn.Linear(256, 16, bias=False), 4, 128, False)
    assert q.bits_per_weight == 4 + 24 / 128


def test_bad_quantlinear_args():
    with pytest.raises(ValueError, match="bits=5"):
        QuantLinear(64, 8, 5, 32, True)
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        QuantLinear(64, 8, 4, 48, True)
    with pytest.raises(ValueError, match="act_bits=4"):
        QuantLinear(64, 8, 8, 64, True, act_bits=4)


def test_quantize_skip_overrides_filter(capsys):
    model = tiny_random("llama")
    cfg = lessmem.RTNConfig(bits=4, group_size=32, overrides={
        "*.layers.1.*": None, "*.v_proj": {"bits": 8, "group_size": None, "symmetric": True}})
    rep = lessmem.quantize_(model, cfg, filter_fn=lambda name, m: not name.endswith("o_proj"))
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, QuantLinear) and layers[0].self_attn.q_proj.bits == 4
    assert layers[0].self_attn.v_proj.bits == 8
    assert type(layers[0].self_attn.o_proj) is torch.nn.Linear  # filter_fn
    assert type(layers[1].mlp.up_proj) is torch.nn.Linear  # override None
    assert type(model.lm_head) is torch.nn.Linear  # skipped by default
    assert rep["n_quantized"] == 6
    assert "[6/6] rtn" in capsys.readouterr().err  # the per-layer progress


def test_int4pack_export_reimport_identical():
    torch.manual_seed(3)
    q = QuantLinear.from_linear(torch.nn.Linear(256, 64), 4, 64, False)
    assert q.layout == "int4pack" and not hasattr(q, "scale")  # only the op's tensors held
    q2 = QuantLinear.from_quantized(q.quantized_weight())
    assert torch.equal(q.int4pack, q2.int4pack) and torch.equal(q.int4_sz, q2.int4_sz)


def test_memory_held_is_counted_from_tensors():
    model = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    fp32 = sum(m.weight.numel() * 4 for n, m in model.named_modules()
               if type(m) is torch.nn.Linear and n != "lm_head")
    lessmem.quantize_(model, lessmem.RTNConfig(bits=4, group_size=128), progress=False)
    held = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    # 4-bit codes + bf16 (scale, zero) per 128 weights = 4.25 bits: 7.5x smaller than fp32
    assert held == fp32 * 4.25 / 32


LAYOUT_CASES = [  # (bits, group_size, symmetric, act_bits, in, out) -> one per layout/kernel
    (2, 32, False, None, 128, 48), (3, 64, True, None, 192, 40), (4, 32, False, None, 96, 20),
    (4, 64, False, None, 256, 64), (8, None, True, None, 128, 24), (8, None, True, 8, 128, 24),
    (3, 48, False, None, 96, 8),  # group size not a multiple of 32: dequantize + BLAS
]


def _held_tensors(m: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the module references: buffers, parameters and plain tensor attributes."""
    seen = {id(t): t for t in list(m.buffers()) + list(m.parameters())}
    for v in vars(m).values():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        for t in items:
            if isinstance(t, torch.Tensor):
                seen.setdefault(id(t), t)
    return list(seen.values())


@pytest.mark.parametrize("bits,gs,sym,act,k,n", LAYOUT_CASES)
def test_nbytes_is_every_tensor_held(bits, gs, sym, act, k, n):
    torch.manual_seed(0)
    q = QuantLinear.from_linear(torch.nn.Linear(k, n), bits, gs, sym, act_bits=act)
    q(torch.randn(2, k))  # a forward must not leave derived tensors behind
    assert q.nbytes == sum(t.numel() * t.element_size() for t in _held_tensors(q))
    if q.layout == "packed":  # codes at `bits` bits + fp16 scale + uint8 zero point + fp32 bias
        g = k // gs
        assert q.nbytes == n * k * bits // 8 + n * g * 3 + n * 4


@pytest.mark.parametrize("bits,gs,sym,act,k,n", LAYOUT_CASES)
def test_load_state_dict_gives_source_output(bits, gs, sym, act, k, n):
    torch.manual_seed(1)
    src = QuantLinear.from_linear(torch.nn.Linear(k, n), bits, gs, sym, act_bits=act)
    dst = QuantLinear.from_linear(torch.nn.Linear(k, n), bits, gs, sym, act_bits=act)
    x = torch.randn(3, k)
    before = dst(x)  # run once first: nothing computed here may survive the load
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst(x), src(x)) and not torch.equal(before, src(x))
    xb = torch.randn(20, k)  # the many-rows path (dequantize + BLAS) reads the loaded state too
    assert torch.equal(dst(xb), src(xb))
    assert torch.equal(dst.codes(), src.codes()) and dst.nbytes == src.nbytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_keeps_activation_dtype(dtype):
    torch.manual_seed(2)
    lin = torch.nn.Linear(128, 32)
    q = QuantLinear.from_linear(lin, 3, 32, False)
    x = torch.randn(2, 5, 128)
    y = q(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 5, 32)
    torch.testing.assert_close(y.float(), q(x.to(dtype).float()), rtol=1e-2, atol=1e-2)


def test_fused_and_blas_paths_agree():
    """Up to FUSED_MAX_ROWS rows run the fused kernel, more rows dequantize + BLAS."""
    from lessmem.weights.qlinear import FUSED_MAX_ROWS
    torch.manual_seed(4)
    for bits in (2, 3, 4, 8):
        q = QuantLinear.from_linear(torch.nn.Linear(96, 40), bits, 32 if bits < 8 else None,
                                    bits == 8)
        x = torch.randn(FUSED_MAX_ROWS + 1, 96)
        torch.testing.assert_close(q(x[:FUSED_MAX_ROWS]), q(x)[:FUSED_MAX_ROWS],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,gs,sym", [(2, 64, False), (3, 64, False), (4, 64, False), (8, None, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_dtype_change_keeps_the_stored_format(bits, gs, sym, dtype):
    # model.to(bf16) after quantizing: scales stay in their stored dtype, forward still runs
    g = torch.Generator().manual_seed(bits)
    lin = torch.nn.Linear(256, 64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 256, generator=g) * 0.05)
    q = QuantLinear.from_linear(lin, bits=bits, group_size=gs, symmetric=sym)
    x = torch.randn(3, 256, generator=g)
    want = q(x)
    held = {n: b.dtype for n, b in q.named_buffers()}
    q.to(dtype)
    assert {n: b.dtype for n, b in q.named_buffers()} == held
    got = q(x.to(dtype))
    assert got.dtype == dtype
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()
