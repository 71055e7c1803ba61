"""GPTQ, AWQ and SmoothQuant against RTN on the same layer and the same calibration."""

import copy

import pytest
import torch

import lessmem
from lessmem.models import tiny_random
from lessmem.weights.arch import arch_for
from lessmem.weights.calibrate import BlockInputs, calibration_ids, run_block
from lessmem.weights.gptq import _inverse_cholesky, gptq_quantize
from lessmem.weights.rtn import rtn_quantize
from lessmem.weights.solvers import LayerSpec, smooth_block


def _model():
    m = tiny_random("llama", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                    num_layers=2, seed=1)
    with torch.no_grad():  # a few outlier input channels, as trained LLMs have
        for layer in m.model.layers:
            layer.input_layernorm.weight[:4] = 8.0
            layer.post_attention_layernorm.weight[5:8] = 6.0
    return m


CALIB = torch.randint(0, 256, (8 * 64,), generator=torch.Generator().manual_seed(0))


def _block0_error(model, ref_model):
    """Mean squared error of decoder block 0's output on the calibration windows."""
    arch = arch_for("llama")
    ids = calibration_ids(CALIB, None, 8, 64)
    cap = BlockInputs(ref_model, ref_model.model.layers, ids)
    ref = run_block(ref_model.model.layers[0], cap.hidden, cap.kwargs, collect=True)
    out = run_block(model.model.layers[0], cap.hidden, cap.kwargs, collect=True)
    assert arch.blocks == "model.layers"
    return sum(((a - b) ** 2).mean().item() for a, b in zip(out, ref, strict=True)) / len(ref)


@pytest.fixture(scope="module")
def base():
    return _model()


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_block_error_not_worse_than_rtn(base, method, bits):
    cfgs = {"gptq": lessmem.GPTQConfig, "awq": lessmem.AWQConfig}
    rtn = copy.deepcopy(base)
    lessmem.quantize_(rtn, lessmem.RTNConfig(bits=bits, group_size=32), progress=False)
    alg = copy.deepcopy(base)
    cfg = cfgs[method](bits=bits, group_size=32, n_samples=8, seq_len=64, **(
        {"n_grid": 8} if method == "awq" else {}))
    rep = lessmem.quantize_(alg, cfg, calibration=CALIB, progress=False)
    assert rep["calibration"]["tokens"] == 512
    e_rtn, e_alg = _block0_error(rtn, base), _block0_error(alg, base)
    assert e_alg <= e_rtn, (method, bits, e_alg, e_rtn)


def test_gptq_layer_error_act_order_static_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=g) @ torch.randn(128, 128, generator=g)
    x[:, :3] *= 20
    w = torch.randn(64, 128, generator=g)
    h = (2 * x.T.double() @ x.double() / x.shape[0]).float()
    err = lambda q: ((x @ (w - q.dequantize()).T) ** 2).mean().item()  # noqa: E731
    e_rtn = err(rtn_quantize(w, 3, 32, False))
    for kw in ({}, {"static_groups": True}, {"act_order": True, "static_groups": True},
               {"block_size": 16}):
        assert err(gptq_quantize(w, h, 3, 32, False, **kw)) < e_rtn, kw
    assert err(gptq_quantize(w, h, 4, None, True)) < err(rtn_quantize(w, 4, None, True))


def test_gptq_damping_retry_and_failure():
    h = torch.zeros(8, 8, dtype=torch.float64)
    h[0, 0] = 1.0  # singular: only succeeds once damping is raised above 0
    u = _inverse_cholesky(h + torch.diag(torch.tensor([0.0] + [1e-30] * 7, dtype=torch.float64)), 1e-40)
    assert torch.isfinite(u).all()
    with pytest.raises(ValueError, match="not positive definite"):
        _inverse_cholesky(-torch.eye(4, dtype=torch.float64), 0.01)


def test_smoothquant_folding_keeps_the_product(base):
    model = copy.deepcopy(base)
    arch = arch_for("llama")
    ids = calibration_ids(CALIB, None, 8, 64)
    cap = BlockInputs(model, model.model.layers, ids)
    block = model.model.layers[0]
    before = run_block(block, cap.hidden, cap.kwargs, collect=True)
    w_before = block.self_attn.q_proj.weight.clone()
    specs = {n: LayerSpec(8, 128, True) for st in arch.stages for n in st}
    info = smooth_block(block, arch, cap.hidden, cap.kwargs, specs, alpha=0.5)
    after = run_block(block, cap.hidden, cap.kwargs, collect=True)
    assert not torch.equal(w_before, block.self_attn.q_proj.weight)  # weights did change
    assert info["input_layernorm"]["act_absmax_after"] < info["input_layernorm"]["act_absmax_before"]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_smoothquant_w8a8_close(base):
    model = copy.deepcopy(base)
    lessmem.quantize_(model, lessmem.SmoothQuantConfig(n_samples=8, seq_len=64), calibration=CALIB,
                      progress=False)
    assert model.model.layers[0].mlp.up_proj.act_bits == 8
    x = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        a, b = base(x).logits, model(x).logits
    assert ((a - b).norm() / a.norm()).item() < 0.05
