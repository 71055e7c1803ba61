"""Bad configs and bad inputs give clear ValueErrors."""

import pytest
import torch

import lessmem
from lessmem.models import tiny_random
from lessmem.weights import AWQConfig, GPTQConfig, RTNConfig, SmoothQuantConfig, WeightConfig


@pytest.mark.parametrize("make,match", [
    (lambda: GPTQConfig(bits=7), r"bits=7 is not supported; allowed: 2, 3, 4, 8"),
    (lambda: RTNConfig(bits=True), r"bits=True"),
    (lambda: RTNConfig(group_size=100), r"group_size=100; allowed: None \(per-channel\), 32"),
    (lambda: RTNConfig(bits=8, group_size=128), r"bits=8 is per-channel symmetric"),
    (lambda: GPTQConfig(damp=0), r"damp=0 must be a number in \(0.0, 1.0\]"),
    (lambda: GPTQConfig(act_order=True), r"act_order=True with group_size set needs static_groups"),
    (lambda: AWQConfig(n_grid=0), r"n_grid=0"),
    (lambda: AWQConfig(max_shrink=0.95), r"max_shrink=0.95"),
    (lambda: SmoothQuantConfig(alpha=1.5), r"alpha=1.5"),
    (lambda: SmoothQuantConfig(bits=4), r"bits=4 is not supported; allowed: 8"),
    (lambda: GPTQConfig(n_samples=0), r"n_samples=0"),
    (lambda: RTNConfig(overrides={"*.v_proj": {"bitz": 8}}), r"unknown: \['bitz'\]"),
    (lambda: RTNConfig(overrides={"*.v_proj": {"bits": 5}}), r"bits=5 is not supported"),
    (lambda: WeightConfig.from_dict({"method": "magic"}), r"method='magic'; allowed: rtn, gptq"),
])
def test_bad_configs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_roundtrip_dict():
    for c in (RTNConfig(bits=3, group_size=64, overrides={"*.o_proj": None}),
              GPTQConfig(act_order=True, static_groups=True), AWQConfig(n_grid=5),
              SmoothQuantConfig(alpha=0.8)):
        assert WeightConfig.from_dict(c.to_dict()) == c


def test_group_size_not_dividing_in_features():
    model = tiny_random("llama", hidden_size=96, num_heads=4, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(ValueError, match=r"group_size=64 does not divide in_features=96 of "
                                         r"'model.layers.0.self_attn.q_proj'; allowed here: \[32\]"):
        lessmem.quantize_(model, RTNConfig(group_size=64), progress=False)
    # with the fallback the 96-wide inputs take groups of 32, the 128-wide ones keep 64
    lessmem.quantize_(model, RTNConfig(group_size=64, group_fallback=True), progress=False)
    assert model.model.layers[0].self_attn.q_proj.group_size == 32
    assert model.model.layers[0].mlp.down_proj.group_size == 64


def test_calibration_too_short():
    model = tiny_random("llama")
    with pytest.raises(ValueError, match=r"calibration text is too short: 100 tokens, but "
                                         r"n_samples=4 x seq_len=64 needs 256"):
        lessmem.quantize_(model, GPTQConfig(group_size=32, n_samples=4, seq_len=64),
                          calibration=torch.randint(0, 256, (100,)), progress=False)


def test_text_calibration_needs_tokenizer():
    with pytest.raises(ValueError, match="needs tokenizer"):
        lessmem.quantize_(tiny_random("llama"), GPTQConfig(group_size=32), calibration="some text",
                          progress=False)


def test_unknown_architecture_for_calibration():
    model = tiny_random("llama")
    model.config.model_type = "gpt_bigcode"
    with pytest.raises(ValueError, match="model_type='gpt_bigcode' has no entry"):
        lessmem.quantize_(model, AWQConfig(group_size=32), calibration=torch.zeros(20000, dtype=torch.long),
                          progress=False)


def test_not_a_config():
    with pytest.raises(ValueError, match="must be a weight config"):
        lessmem.quantize_(tiny_random("llama"), {"bits": 4})
