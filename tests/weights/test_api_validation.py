"""Bad input to the weights API: a clear ValueError/TypeError naming the value and what is
allowed, raised before any work; never a raw error from deep inside (table-driven)."""

from pathlib import Path

import pytest
import torch

import lessmem
from lessmem.models import tiny_random, tiny_tokenizer
from lessmem.weights import (
    AWQConfig,
    GGUFConfig,
    GPTQConfig,
    HQQConfig,
    RTNConfig,
    SmoothQuantConfig,
)
from lessmem.weights.gguf_linear import GGUFLinear
from lessmem.weights.gptq import gptq_quantize
from lessmem.weights.hqq import hqq_quantize
from lessmem.weights.qlinear import QuantLinear
from lessmem.weights.rtn import rtn_quantize

W = torch.randn(8, 64)
H = torch.eye(64) + 0.1

CONFIG_CASES = [
    (RTNConfig, dict(bits="4"), "bits='4' is not supported; allowed: 2, 3, 4, 8"),
    (RTNConfig, dict(group_size="128"), "group_size='128'; allowed: None"),
    (RTNConfig, dict(group_size=0), "group_size=0; allowed: None"),
    (RTNConfig, dict(symmetric="False"), "symmetric='False' must be True or False"),
    (RTNConfig, dict(group_fallback="no"), "group_fallback='no' must be True or False"),
    (RTNConfig, dict(skip=None), "skip=None must be a name pattern"),
    (RTNConfig, dict(skip=["lm_head", 3]), "must be a name pattern or a list"),
    (RTNConfig, dict(overrides="x"), "overrides='x' must be a dict"),
    (RTNConfig, dict(overrides={"*.q_proj": "bits"}), "'bits' must be a dict {field: value} or None"),
    (RTNConfig, dict(overrides={"*.q_proj": {"bitz": 8}}), "unknown: ['bitz']"),
    (GPTQConfig, dict(act_order="yes"), "act_order='yes' must be True or False"),
    (GPTQConfig, dict(static_groups=1), "static_groups=1 must be True or False"),
    (GPTQConfig, dict(true_sequential="True"), "true_sequential='True' must be True or False"),
    (GPTQConfig, dict(n_samples="32"), "n_samples='32' must be an integer"),
    (GPTQConfig, dict(seq_len="512"), "seq_len='512' must be an integer"),
    (GPTQConfig, dict(block_size="128"), "block_size='128' must be an integer"),
    (GPTQConfig, dict(damp="0.01"), "damp='0.01' must be a number"),
    (AWQConfig, dict(clip_search="no"), "clip_search='no' must be True or False"),
    (AWQConfig, dict(n_grid="20"), "n_grid='20' must be an integer"),
    (HQQConfig, dict(iters="20"), "iters='20' must be an integer"),
    (SmoothQuantConfig, dict(alpha="0.5"), "alpha='0.5' must be a number"),
    (GGUFConfig, dict(type=4), "type=4 must be a GGUF type or mix name"),
    (GGUFConfig, dict(skip=None), "skip=None must be a name pattern"),
]


@pytest.mark.parametrize("cls,kwargs,words", CONFIG_CASES,
                         ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in CONFIG_CASES])
def test_bad_config_fields(cls, kwargs, words):
    with pytest.raises(ValueError) as e:
        cls(**kwargs)
    assert words in str(e.value) and cls.__name__ in str(e.value)


def test_good_configs_still_build():
    assert RTNConfig(skip=["lm_head"], group_fallback=True).skip == ("lm_head",)
    assert GPTQConfig(act_order=True, static_groups=True, true_sequential=False).act_order
    assert AWQConfig(clip_search=False).clip_search is False
    assert GGUFConfig("Q8_0", skip="lm_head").skip == ("lm_head",)


FUNCTION_CASES = [
    ("rtn group_size 0", lambda: rtn_quantize(W, 4, 0, False), "group_size=0 must be a positive integer"),
    ("rtn group_size str", lambda: rtn_quantize(W, 4, "32", False), "group_size='32' must be a positive"),
    ("rtn group not dividing", lambda: rtn_quantize(W, 4, 48, False), "group_size=48 does not divide"),
    ("rtn int weight", lambda: rtn_quantize(W.long(), 4, 32, False), "2-D floating tensor"),
    ("rtn 1-D weight", lambda: rtn_quantize(W[0], 4, 32, False), "2-D floating tensor"),
    ("rtn bits 5", lambda: rtn_quantize(W, 5, 32, False), "bits=5; allowed: 2, 3, 4, 8"),
    ("hqq group_size 0", lambda: hqq_quantize(W, 4, 0), "group_size=0 must be a positive integer"),
    ("gptq group_size 0", lambda: gptq_quantize(W, H, 4, 0, False), "group_size=0 must be a positive"),
    ("gptq act_order dynamic groups", lambda: gptq_quantize(W, H, 4, 32, False, act_order=True),
     "act_order=True with group_size set needs static_groups=True"),
    ("gptq Hessian shape", lambda: gptq_quantize(W, torch.eye(32), 4, 32, False), "[64, 64] Hessian"),
    ("QuantLinear group_size 0", lambda: QuantLinear(64, 8, 4, 0, False), "group_size=0 must be"),
    ("QuantLinear group_size None", lambda: QuantLinear(64, 8, 4, None, False), "group_size=None"),
    ("QuantLinear in_features 0", lambda: QuantLinear(0, 8, 4, 32, False), "in_features=0 must be"),
    ("QuantLinear in_features str", lambda: QuantLinear("64", 8, 4, 32, False), "in_features='64'"),
    ("QuantLinear out_features -1", lambda: QuantLinear(64, -1, 4, 32, False), "out_features=-1"),
    ("QuantLinear symmetric str", lambda: QuantLinear(64, 8, 4, 32, "no"), "symmetric='no' must be"),
    ("QuantLinear act_bits True", lambda: QuantLinear(64, 8, 8, 64, True, act_bits=True), "act_bits=True"),
    ("from_linear group_size 0", lambda: QuantLinear.from_linear(torch.nn.Linear(64, 8), 4, 0),
     "group_size=0 must be"),
    ("GGUFLinear in_features str", lambda: GGUFLinear("256", 8, "q4_k"), "in_features='256' must be"),
    ("GGUFLinear out_features 0", lambda: GGUFLinear(256, 0, "q4_k"), "out_features=0 must be"),
    ("GGUFLinear in_features not blocks", lambda: GGUFLinear(288, 8, "q4_k"), "block size 256"),
    ("GGUFLinear bias str", lambda: GGUFLinear(256, 8, "q4_k", bias="yes"), "bias='yes' must be"),
]


@pytest.mark.parametrize("what,call,words", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_bad_arguments_to_functions_and_layers(what, call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert words in str(e.value)


def _layers():
    torch.manual_seed(0)
    return {
        "int4pack": QuantLinear.from_linear(torch.nn.Linear(128, 64), 4, 32),
        "packed 3-bit": QuantLinear.from_linear(torch.nn.Linear(128, 64), 3, 32),
        "int8": QuantLinear.from_linear(torch.nn.Linear(128, 64), 8, None, True),
        "w8a8": QuantLinear.from_linear(torch.nn.Linear(128, 64), 8, None, True, act_bits=8),
        "gguf q8_0": GGUFLinear.from_linear(torch.nn.Linear(128, 64), "q8_0"),
    }


@pytest.mark.parametrize("layout", list(_layers()))
@pytest.mark.parametrize("features", [64, 127, 256])
def test_wrong_input_features_every_layout(layout, features):
    layer = _layers()[layout]
    assert layer(torch.randn(2, 128)).shape == (2, 64)
    for rows in (1, 40):  # the fused kernels and the dequantize + BLAS path
        with pytest.raises(ValueError, match=f"input has {features} features; this layer takes 128"):
            layer(torch.randn(rows, features))


def test_gptq_act_order_paths_that_are_allowed():
    q = gptq_quantize(W, H, 4, 32, False, act_order=True, static_groups=True)
    r = gptq_quantize(W, H, 4, None, False, act_order=True)  # one group per row
    assert torch.isfinite(q.dequantize()).all() and torch.isfinite(r.dequantize()).all()


QUANTIZE_CASES = [
    ("model None", lambda m: lessmem.quantize_(None, RTNConfig()), TypeError,
     "needs a torch.nn.Module"),
    ("model a config", lambda m: lessmem.quantize_(m.config, RTNConfig()), TypeError,
     "got LlamaConfig"),
    ("filter_fn not callable", lambda m: lessmem.quantize_(m, RTNConfig(group_size=32), filter_fn=3),
     TypeError, "filter_fn must be None or a function"),
    ("progress str", lambda m: lessmem.quantize_(m, RTNConfig(group_size=32), progress="no"),
     TypeError, "progress must be True or False"),
    ("save_quantized of None", lambda m: lessmem.save_quantized(None, "/nonexistent/x"), TypeError,
     "save_quantized needs a transformers model"),
    ("config a dict", lambda m: lessmem.quantize_(m, {"bits": 4}), ValueError, "must be a weight config"),
    ("missing Path", lambda m: lessmem.quantize_(m, GPTQConfig(group_size=32), progress=False,
                                                 calibration=Path("/nope/c.txt")),
     ValueError, "'/nope/c.txt' is not an existing file"),
    ("float token ids", lambda m: lessmem.quantize_(m, GPTQConfig(group_size=32), progress=False,
                                                    calibration=torch.rand(20000)),
     ValueError, "must be an integer tensor"),
    ("token ids outside the vocabulary", lambda m: lessmem.quantize_(
        m, GPTQConfig(group_size=32, n_samples=1, seq_len=8), progress=False,
        calibration=torch.full((8,), 100000)), ValueError, "outside the model's vocabulary"),
    ("a file name that does not exist", lambda m: lessmem.quantize_(
        m, GPTQConfig(group_size=32), progress=False, calibration="train.txt", tokenizer=tiny_tokenizer()),
     ValueError, "calibration='train.txt' was taken as text: no such file exists"),
]


@pytest.mark.parametrize("what,call,exc,words", QUANTIZE_CASES, ids=[c[0] for c in QUANTIZE_CASES])
def test_bad_quantize_calls(what, call, exc, words):
    m = tiny_random("llama")
    before = {n: type(mod) for n, mod in m.named_modules()}
    with pytest.raises(exc) as e:
        call(m)
    assert words in str(e.value)
    assert {n: type(mod) for n, mod in m.named_modules()} == before  # nothing was replaced


def test_one_line_calibration_text_is_text_not_a_path():
    m = tiny_random("llama")
    text = "word " * 2000  # one line, 10000 characters: once an OSError (file name too long)
    rep = lessmem.quantize_(m, GPTQConfig(group_size=32, n_samples=2, seq_len=32), calibration=text,
                            tokenizer=tiny_tokenizer(), progress=False)
    assert rep["calibration"]["source"] == "text given by the caller (10000 characters)"
    assert rep["calibration"]["tokens"] == 64


def test_calibration_text_uses_the_tokenizer_lessmem_load_returned(tmp_path):
    src = tiny_random("llama")
    src.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, tok = lessmem.load(str(tmp_path))
    rep = lessmem.quantize_(model, GPTQConfig(group_size=32, n_samples=2, seq_len=16),
                            calibration="some calibration text, " * 20, progress=False)
    assert rep["calibration"]["tokens"] == 32
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    lessmem.save_quantized(model, tmp_path / "q")  # the tokenizer travels with the model
    model2, tok2 = lessmem.load(str(tmp_path / "q"))
    assert tok2("héllo")["input_ids"] == tok("héllo")["input_ids"]
    with pytest.raises(ValueError, match="needs tokenizer"):  # a model built by hand has none
        lessmem.quantize_(tiny_random("llama"), GPTQConfig(group_size=32), calibration="text",
                          progress=False)


@pytest.mark.parametrize("arg,exc,words", [
    ({"method": "rtn", "bitz": 4}, ValueError, "RTNConfig.from_dict: unknown keys ['bitz']"),
    ({"method": "nope"}, ValueError, "method='nope'; allowed: rtn"),
    ({"method": "gptq", "act_order": "no"}, ValueError, "act_order='no' must be True or False"),
    (None, TypeError, "needs a dict as written by to_dict()"),
])
def test_weight_config_from_dict(arg, exc, words):
    from lessmem.weights.config import WeightConfig

    with pytest.raises(exc) as e:
        WeightConfig.from_dict(arg)
    assert words in str(e.value)
    cfg = GPTQConfig(group_size=32, skip=("lm_head", "*.v_proj"))
    assert WeightConfig.from_dict(cfg.to_dict()) == cfg  # the round trip still holds


def test_load_quantized_needs_a_path():
    from lessmem.weights.checkpoint import load_quantized

    with pytest.raises(TypeError, match="load_quantized needs a directory path, got NoneType"):
        load_quantized(None)
