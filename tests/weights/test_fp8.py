"""FP8 weights (``weights.fp8``): FP8Linear's math (W8A8 through ``torch._scaled_mm`` and
weight-only), saturation, ``quantize_`` with ``FP8Config``, checkpoints and the CLI."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import lessmem
from lessmem.cli import main
from lessmem.models import tiny_random, tiny_tokenizer
from lessmem.weights import FP8Config, FP8Linear, WeightConfig
from lessmem.weights.checkpoint import load_quantized
from lessmem.weights.fp8 import FP8_MAX, fp8_quantize, quantize_activations

FP8 = torch.float8_e4m3fn
BAD = "not a valid lessmem checkpoint"
Q = "model.layers.0.mlp.down_proj"  # in 128, out 64


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def _linear(k=256, n=96, bias=True, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Linear(k, n, bias=bias)


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the layer


def test_weight_format_scales_and_bytes():
    lin = _linear(256, 96)
    q = FP8Linear.from_linear(lin)
    w = lin.weight.detach()
    assert q.qweight.dtype == FP8 and q.qweight.shape == (96, 256)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (96, 1)
    assert q.bias.dtype == torch.float32 and torch.equal(q.bias, lin.bias.detach())
    torch.testing.assert_close(q.scale, w.abs().amax(1, keepdim=True) / 448, rtol=0, atol=0)
    assert torch.equal(q.qweight.float().abs().amax(1), torch.full((96,), FP8_MAX))  # each row's max lands on 448
    assert q.nbytes == 96 * 256 + 96 * 4 + 96 * 4  # codes + scales + bias
    assert q.bits_per_weight == 8 + 32 / 256
    assert rel_rms(q.dequantized_weight(), w) < 0.05
    assert "fmt=e4m3" in repr(q) and "act=fp8" in repr(q)


def test_w8a8_forward_is_the_float_math_of_its_fp8_operands():
    lin = _linear(256, 96)
    q = FP8Linear.from_linear(lin, act="fp8")
    x = _x(2, 5, 256) * torch.linspace(0.01, 10, 256)  # rows of different ranges
    x2 = x.reshape(-1, 256)
    sx = (x2.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (x2 / sx).clamp(-448, 448).to(FP8)
    xq2, sx2 = quantize_activations(x2)
    assert torch.equal(xq2.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(sx2, sx)
    ref = (xq.float() @ q.qweight.float().T) * sx * q.scale.T + q.bias
    y = q(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y.reshape(-1, 96), ref, rtol=1e-6, atol=1e-5)
    assert q.fallback_reason is None  # _scaled_mm ran (CPU)
    assert rel_rms(y, lin(x)) < 0.05


def test_weight_only_forward_is_f_linear_of_the_dequantized_weight():
    lin = _linear(256, 96)
    q = FP8Linear.from_linear(lin, act=None)
    x = _x(7, 256)
    assert torch.equal(q(x), F.linear(x, q.dequantized_weight(), q.bias))
    xb = x.bfloat16()
    yb = q(xb)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, F.linear(xb, q.dequantized_weight().bfloat16(), q.bias.bfloat16()))
    assert rel_rms(q(x), lin(x)) < 0.05


@pytest.mark.parametrize("act", ["fp8", None])
def test_dtypes_and_shapes(act):
    q = FP8Linear.from_linear(_linear(64, 32, bias=False), act=act)
    assert q.bias is None
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        y = q(_x(3, 64).to(dt))
        assert y.dtype == dt and y.shape == (3, 32) and torch.isfinite(y).all()
    assert q(torch.zeros(0, 64)).shape == (0, 32)
    assert q(_x(64)).shape == (32,)  # one vector


def test_half_keeps_the_stored_format():
    q = FP8Linear.from_linear(_linear(64, 32), act="fp8")
    before = {n: t.clone() for n, t in q.state_dict().items()}
    q.half()
    assert q.qweight.dtype == FP8 and q.scale.dtype == torch.float32 and q.bias.dtype == torch.float32
    for n, t in q.state_dict().items():
        assert torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)), n  # bit for bit
    assert q(_x(2, 64).half()).dtype == torch.float16
    q.to(torch.bfloat16).to("cpu")
    assert q.qweight.dtype == FP8 and q.scale.dtype == torch.float32


@pytest.mark.parametrize("features", [63, 65, 128])
@pytest.mark.parametrize("act", ["fp8", None])
def test_wrong_input_features(act, features):
    q = FP8Linear.from_linear(_linear(64, 32), act=act)
    with pytest.raises(ValueError, match=f"input has {features} features; this layer takes 64"):
        q(_x(2, features))


@pytest.mark.parametrize("call,words", [
    (lambda: FP8Linear(64, 32, act="int8"), "act='int8'; allowed: 'fp8' (W8A8) or None"),
    (lambda: FP8Linear(64, 32, fmt="e5m2"), "fmt='e5m2'; allowed: 'e4m3'"),
    (lambda: FP8Linear(0, 32), "in_features=0 must be a positive integer"),
    (lambda: FP8Linear(64, 32, bias="yes"), "bias='yes' must be True or False"),
    (lambda: FP8Linear.from_quantized(torch.zeros(4, 8), torch.ones(4)), "2-D torch.float8_e4m3fn"),
    (lambda: FP8Linear.from_quantized(torch.zeros(4, 8).to(FP8), torch.ones(3)), "scale must be a floating"),
    (lambda: FP8Linear.from_linear(torch.nn.Linear(8, 4), act="int8"), "act='int8'"),
    (lambda: fp8_quantize(torch.zeros(4, 8, dtype=torch.long)), "2-D floating tensor"),
    (lambda: fp8_quantize(torch.ones(4, 8), scale=torch.tensor([1.0, 0, 1, 1])), "finite positive"),
])
def test_bad_arguments(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert words in str(e.value)


# ------------------------------------------------------------------ saturation and zeros


def test_weights_beyond_448_scale_saturate():
    w = _x(4, 32)
    scale = torch.full((4, 1), 0.001)  # 448 * 0.001 = 0.448: most of these weights are outliers
    q, s = fp8_quantize(w, scale)
    assert torch.equal(s, scale) and not torch.isnan(q.float()).any()
    big = w.abs() > 448 * 0.001 * 1.07  # beyond the rounding interval of 448
    assert big.any()
    assert torch.equal(q.float()[big], torch.sign(w[big]) * 448)
    layer = FP8Linear.from_quantized(q, s, act=None)
    assert layer.dequantized_weight().abs().max() <= 448 * 0.001 + 1e-7


def test_row_maximum_never_overflows():
    # values whose w / (amax / 448) rounds a hair above 448 in float32 must clamp, not become NaN
    w = torch.tensor([[3.0, -1.0, 0.1], [1e-30, -7e-31, 0.0], [6.1e4, 1.0, -6.1e4]])
    q, s = fp8_quantize(w)
    assert torch.isfinite(q.float()).all() and (q.float().abs().amax(1) == 448).all()


def test_zero_rows_and_zero_inputs():
    w = _x(8, 64)
    w[3] = 0
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    for act in ("fp8", None):
        q = FP8Linear.from_linear(lin, act=act)
        assert q.scale[3].item() == 1.0 and torch.equal(q.qweight[3].float(), torch.zeros(64))
        x = _x(5, 64)
        x[2] = 0  # an all-zero token: scale clamped at 1e-12, no NaN
        y = q(x)
        assert torch.isfinite(y).all() and (y[:, 3] == 0).all() and (y[2] == 0).all()


def test_activation_outliers_are_kept_by_the_per_token_scale():
    q = FP8Linear.from_linear(_linear(128, 64), act="fp8")
    x = _x(4, 128)
    x[1, 7] = 1e4  # one huge activation in token 1: only that token's scale grows
    y, ref = q(x), F.linear(x, q.dequantized_weight(), q.bias)
    assert torch.isfinite(y).all()
    assert rel_rms(y[[0, 2, 3]], ref[[0, 2, 3]]) < 0.05
    assert rel_rms(y[1], ref[1]) < 0.05  # the outlier itself is exact-ish (448 on the grid)


# ------------------------------------------------------------------ the fallback


def test_scaled_mm_failure_falls_back_once(monkeypatch):
    q = FP8Linear.from_linear(_linear(64, 32), act="fp8")
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no FP8 kernel here\nsecond line")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    x = _x(3, 64)
    with pytest.warns(UserWarning, match="torch._scaled_mm raised RuntimeError: no FP8 kernel here; this "
                                         "layer uses the weight-only FP8 path"):
        y = q(x)
    assert torch.equal(y, F.linear(x, q.dequantized_weight(), q.bias))
    assert q.fallback_reason.startswith("torch._scaled_mm raised RuntimeError")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second try
        assert torch.equal(q(x), y)
    assert len(calls) == 1
    monkeypatch.undo()
    q.to("cpu")  # a move forgets the decision
    assert q.fallback_reason is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q(x)
    assert q.fallback_reason is None


def test_torch_compile_matches_eager():
    for act in ("fp8", None):
        q = FP8Linear.from_linear(_linear(64, 48), act=act)
        x = _x(3, 64)
        compiled = torch.compile(q, fullgraph=False)
        torch.testing.assert_close(compiled(x), q(x), rtol=1e-6, atol=1e-6)
        assert q.fallback_reason is None


# ------------------------------------------------------------------ config and quantize_


def test_config():
    c = FP8Config()
    assert (c.act, c.fmt, c.skip, c.method, c.needs_calibration) == ("fp8", "e4m3", ("lm_head",), "fp8", False)
    c = FP8Config(act=None, skip="*.o_proj", overrides={"*.down_proj": {"act": "fp8"}, "*.q_proj": None})
    assert c.for_module("model.layers.0.mlp.down_proj").act == "fp8"
    assert c.for_module("model.layers.0.mlp.up_proj").act is None
    assert c.for_module("model.layers.0.self_attn.q_proj") is None
    assert c.for_module("model.layers.0.self_attn.o_proj") is None
    assert WeightConfig.from_dict(c.to_dict()) == c
    assert json.loads(json.dumps(c.to_dict()))["method"] == "fp8"


@pytest.mark.parametrize("kwargs,words", [
    (dict(act="int8"), "FP8Config act='int8'; allowed: 'fp8' (W8A8) or None (weight-only)"),
    (dict(act="none"), "act='none'"),
    (dict(act=True), "act=True"),
    (dict(fmt="e5m2"), "FP8Config fmt='e5m2'; allowed: 'e4m3'"),
    (dict(skip=None), "FP8Config skip=None must be a name pattern"),
    (dict(overrides={"*.q_proj": {"bits": 4}}), "unknown: ['bits']"),
    (dict(overrides={"*.q_proj": {"act": "int8"}}), "act='int8'"),
])
def test_bad_config(kwargs, words):
    with pytest.raises(ValueError) as e:
        FP8Config(**kwargs)
    assert words in str(e.value)


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("act", ["fp8", None])
def test_quantize_tiny_llama(act):
    ref = tiny_random("llama")
    m = tiny_random("llama")
    rep = lessmem.quantize_(m, lessmem.FP8Config(act=act), progress=False)
    assert rep["method"] == "fp8" and rep["n_quantized"] == 14 and rep["config"]["act"] == act
    layers = [mod for mod in m.modules() if isinstance(mod, FP8Linear)]
    assert len(layers) == 14 and all(mod.act == act for mod in layers)
    assert type(m.lm_head) is torch.nn.Linear  # skipped by default, as RTN does
    assert rel_rms(_logits(m, IDS), _logits(ref, IDS)) < 0.05
    n_weights = sum(mod.qweight.numel() for mod in layers)
    n_rows = sum(mod.out_features for mod in layers)
    assert rep["bytes_held"] == sum(mod.nbytes for mod in layers) == n_weights + 4 * n_rows  # no bias
    assert 8 < rep["bits_per_weight"] == 8 * (n_weights + 4 * n_rows) / n_weights < 8.6
    assert m._lessmem_quant == rep["config"]
    if act == "fp8":
        assert all(mod.fallback_reason is None for mod in layers)


def test_quantize_filter_fn_skip_and_bias():
    m = tiny_random("qwen2")  # q/k/v have a bias
    ref = tiny_random("qwen2")
    rep = lessmem.quantize_(m, FP8Config(skip=("lm_head", "*.o_proj")),
                            filter_fn=lambda name, mod: ".mlp." not in name, progress=False)
    assert rep["n_quantized"] == 6  # q, k, v of two layers
    attn = m.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FP8Linear) and attn.q_proj.bias is not None
    assert type(attn.o_proj) is torch.nn.Linear and type(m.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert rel_rms(_logits(m, IDS), _logits(ref, IDS)) < 0.05


def test_quantize_moe_splits_experts_first():
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    def build():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return tf.AutoModelForCausalLM.from_config(cfg).eval()

    m, ref = build(), build()
    rep = lessmem.quantize_(m, FP8Config(act="fp8"), progress=False)
    assert rep["experts_split"] == 1
    experts = [n for n, mod in m.named_modules() if isinstance(mod, FP8Linear) and ".experts." in n]
    assert len(experts) == 4 * 2  # gate_up_proj and down_proj of every expert
    assert rel_rms(_logits(m, IDS), _logits(ref, IDS)) < 0.05


# ------------------------------------------------------------------ checkpoints


@pytest.fixture
def ckpt(tmp_path):
    m = tiny_random("llama")
    lessmem.quantize_(m, FP8Config(overrides={"*.up_proj": {"act": None}}), progress=False)
    lessmem.save_quantized(m, tmp_path)
    return m, tmp_path


def test_roundtrip_bit_exact(ckpt):
    m, d = ckpt
    meta = json.loads((d / "lessmem_quant.json").read_text())
    assert meta["quantization"]["method"] == "fp8" and meta["modules"] == {}
    assert meta["fp8_modules"][Q] == {"act": "fp8", "fmt": "e4m3", "in_features": 128, "out_features": 64,
                                      "bias": False}
    assert meta["fp8_modules"]["model.layers.1.mlp.up_proj"]["act"] is None
    stored = load_file(str(d / "model.safetensors"))
    assert stored[f"{Q}.qweight"].dtype == FP8 and stored[f"{Q}.scale"].dtype == torch.float32
    m2, tok = load_quantized(d)
    assert tok is None
    for name, mod in m.named_modules():
        if isinstance(mod, FP8Linear):
            mod2 = m2.get_submodule(name)
            assert isinstance(mod2, FP8Linear) and mod2.act == mod.act
            assert torch.equal(mod2.qweight.view(torch.uint8), mod.qweight.view(torch.uint8))
            assert torch.equal(mod2.scale, mod.scale) and mod2.scale.dtype == torch.float32
    assert torch.equal(_logits(m, IDS), _logits(m2, IDS))
    m3, _ = lessmem.load(str(d))
    assert torch.equal(_logits(m, IDS), _logits(m3, IDS))


def test_roundtrip_with_bias_bf16(tmp_path):
    m = tiny_random("qwen2", dtype=torch.bfloat16)
    lessmem.quantize_(m, FP8Config(), progress=False)
    lessmem.save_quantized(m, tmp_path)
    m2, _ = load_quantized(tmp_path)
    assert m2.model.layers[0].self_attn.q_proj.bias is not None
    assert torch.equal(_logits(m, IDS), _logits(m2, IDS))


def _edit_tensors(d, change):
    t = load_file(str(d / "model.safetensors"))
    change(t)
    save_file(t, str(d / "model.safetensors"))


def _edit_meta(d, change):
    p = d / "lessmem_quant.json"
    meta = json.loads(p.read_text())
    change(meta)
    p.write_text(json.dumps(meta))


TAMPERED_TENSORS = [
    ("qweight as float16", lambda t: t.update({f"{Q}.qweight": torch.zeros(64, 128, dtype=torch.float16)}),
     f"tensor '{Q}.qweight' is torch.float16 [64, 128]; the model needs torch.float8_e4m3fn [64, 128]"),
    ("qweight as uint8", lambda t: t.update({f"{Q}.qweight": torch.zeros(64, 128, dtype=torch.uint8)}),
     f"tensor '{Q}.qweight' is torch.uint8 [64, 128]"),
    ("qweight of another shape", lambda t: t.update({f"{Q}.qweight": torch.zeros(64, 64).to(FP8)}),
     f"tensor '{Q}.qweight' is torch.float8_e4m3fn [64, 64]"),
    ("scale as float16", lambda t: t.update({f"{Q}.scale": torch.ones(64, 1, dtype=torch.float16)}),
     f"tensor '{Q}.scale' is torch.float16 [64, 1]; the model needs torch.float32 [64, 1]"),
    ("scale flat", lambda t: t.update({f"{Q}.scale": torch.ones(64)}), f"tensor '{Q}.scale' is torch.float32 [64]"),
    ("scale missing", lambda t: t.pop(f"{Q}.scale"), f"lacks ['{Q}.scale']"),
    ("a stray bias", lambda t: t.update({f"{Q}.bias": torch.zeros(64)}), f"holds '{Q}.bias'"),
]


@pytest.mark.parametrize("what,change,words", TAMPERED_TENSORS, ids=[c[0] for c in TAMPERED_TENSORS])
def test_tampered_tensors_refused(ckpt, what, change, words):
    _, d = ckpt
    _edit_tensors(d, change)
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(d)
    assert words in str(e.value)


def _set_fp8(field, value):
    def change(meta):
        meta["fp8_modules"][Q][field] = value
    return change


TAMPERED_META = [
    ("act int8", _set_fp8("act", "int8"), f"fp8_modules['{Q}'].act='int8'; allowed"),
    ("act as bool", _set_fp8("act", True), f"fp8_modules['{Q}'].act=True has the wrong type"),
    ("fmt e5m2", _set_fp8("fmt", "e5m2"), f"fp8_modules['{Q}'].fmt='e5m2'; allowed"),
    ("in_features 65536", _set_fp8("in_features", 65536), "the model's layer is 64 x 128"),
    ("bias flag flipped", _set_fp8("bias", True), "(bias True)"),
    ("a field missing", lambda m: m["fp8_modules"][Q].pop("fmt"), "must have exactly the fields"),
    ("fp8_modules a list", lambda m: m.update(fp8_modules=[]), "fp8_modules must be an object"),
    ("also in modules", lambda m: m["modules"].update({Q: {"bits": 8, "group_size": 128, "symmetric": True,
                                                           "act_bits": None, "in_features": 128,
                                                           "out_features": 64, "bias": False}}),
     "listed in both modules and fp8_modules"),
    ("a module that is not a linear", lambda m: m["fp8_modules"].update(
        {"model.layers.0.mlp": dict(m["fp8_modules"][Q])}), "not a linear layer"),
    ("entries dropped", lambda m: m.pop("fp8_modules"), "which the model does not have"),
]


@pytest.mark.parametrize("what,change,words", TAMPERED_META, ids=[c[0] for c in TAMPERED_META])
def test_tampered_meta_refused(ckpt, what, change, words):
    _, d = ckpt
    _edit_meta(d, change)
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(d)
    assert words in str(e.value)


# ------------------------------------------------------------------ CLI


def test_cli_quantize_fp8(tmp_path, capsys):
    src = tmp_path / "tiny"
    tiny_random("llama").save_pretrained(str(src))
    tiny_tokenizer().save_pretrained(str(src))
    capsys.readouterr()
    for act, want in (("fp8", "fp8"), ("none", None)):
        out = tmp_path / f"q-{act}"
        argv = ["quantize", "--model", str(src), "--method", "fp8", "--out", str(out), "--json"]
        assert main(argv + ([] if act == "fp8" else ["--act", act])) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["method"] == "fp8" and rep["quantized_linears"] == 14 and rep["bits"] == 8
        assert rep["group_sizes_used"] == {"per-channel": 14}
        assert rep["act"] == (want or "none (weight-only)")
        m2, tok = lessmem.load(str(out))
        up = m2.model.layers[1].mlp.up_proj
        assert isinstance(up, FP8Linear) and up.act == want
        x = torch.tensor([tok("fox")["input_ids"]])
        assert torch.isfinite(m2(x).logits).all()


def test_cli_bad_act(tmp_path, capsys):
    assert main(["quantize", "--method", "fp8", "--act", "int8", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--act int8: allowed: fp8, none" in err and err.count("\n") == 1
