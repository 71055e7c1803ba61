"""Model presets and config.json parsing, hardware presets and overrides, weight formats."""

import json

import pytest

from lessmem.plan import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    from_hf_config,
    get_hardware,
    get_model,
    get_weight_format,
    pcie_bandwidth,
    weight_footprint,
)
from lessmem.plan.weights import GGUF_TYPES, mix_type


def test_required_presets_exist():
    for name in ("llama-3-8b", "llama-2-7b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "smollm2-135m"):
        assert name in MODEL_PRESETS
    for name in ("h100", "h200", "a100-80g", "l4", "rtx-4090", "mi300x", "laptop-cpu"):
        assert name in HARDWARE_PRESETS


@pytest.mark.parametrize("name,params", [
    ("llama-3-8b", 8.03e9), ("llama-2-7b", 6.74e9), ("llama-3-70b", 70.55e9), ("mistral-7b", 7.24e9),
    ("qwen2.5-7b", 7.62e9), ("smollm2-135m", 134.5e6),
])
def test_param_counts_from_shapes(name, params):
    assert get_model(name).n_params == pytest.approx(params, rel=2e-3)


def test_smollm2_dims():
    m = get_model("smollm2-135m")
    assert (m.layers, m.kv_heads, m.head_dim, m.hidden, m.vocab, m.max_context) == (30, 3, 64, 576, 49152, 8192)


def _write(tmp_path, obj, name="config.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_hf_config_parsed_and_params_estimated(tmp_path):
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "model_type": "llama"}
    m = from_hf_config(_write(tmp_path, cfg))
    ref = get_model("smollm2-135m")
    assert (m.layers, m.kv_heads, m.head_dim, m.n_params) == (30, 3, 64, ref.n_params)
    assert get_model(str(tmp_path)).layers == 30  # a directory holding config.json
    cfg2 = {**cfg, "head_dim": 128, "num_parameters": 1e9, "num_key_value_heads": None}
    m2 = from_hf_config(_write(tmp_path, cfg2, "c2.json"))
    assert (m2.head_dim, m2.kv_heads, m2.n_params) == (128, 9, 1e9)


def test_hf_config_nested_text_config(tmp_path):
    cfg = {"model_type": "llava", "text_config": {"num_hidden_layers": 2, "hidden_size": 64,
                                                  "num_attention_heads": 4, "vocab_size": 10}}
    m = from_hf_config(_write(tmp_path, cfg))
    assert (m.layers, m.kv_heads, m.head_dim, m.intermediate) == (2, 4, 16, 256)


@pytest.mark.parametrize("content,match", [
    ("{not json", "malformed config.json"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}, "missing num_hidden_layers"),
    ({"num_hidden_layers": -2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10},
     "num_hidden_layers=-2 must be a positive integer"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3,
      "vocab_size": 10}, "heads=4 is not a multiple of kv_heads=3"),
    ({"num_hidden_layers": 2, "hidden_size": 65, "num_attention_heads": 4, "vocab_size": 10},
     "not divisible by heads=4"),
])
def test_malformed_configs(tmp_path, content, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(_write(tmp_path, content))


def test_unknown_model_names_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'; choose one of: llama-3-8b, .*config.json"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match=r"does not exist; choose one of"):
        get_model(str(tmp_path / "nope.json"))


def test_pcie_generations():
    assert [round(pcie_bandwidth(g, 16) / 1e9, 1) for g in (3, 4, 5)] == [12.5, 25.0, 50.0]
    assert pcie_bandwidth(4, 4) == pcie_bandwidth(4, 16) / 4
    with pytest.raises(ValueError, match=r"PCIe gen=7; allowed: 1, 2, 3, 4, 5, 6"):
        pcie_bandwidth(7, 16)
    with pytest.raises(ValueError, match=r"PCIe width=x3; allowed"):
        pcie_bandwidth(4, 3)


def test_hardware_overrides():
    hw = get_hardware("h100", hbm_bw=1.5e12, pcie_gen=4, host_ram=2**40, nvme_bw=7e9)
    assert (hw.hbm_bw, hw.pcie_bw, hw.host_ram, hw.nvme_bw) == (1.5e12, 25e9, 2**40, 7e9)
    assert get_hardware("h100", pcie_bw=10e9).pcie_bw == 10e9
    cpu = get_hardware("laptop-cpu")
    assert cpu.unified and [t["tier"] for t in cpu.tiers()] == ["device", "nvme"]
    assert get_hardware("RTX 4090").name == "rtx-4090"
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu'; choose one of: generic-gpu, h100"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match=r"hbm_bw=-1.0 must be a positive bandwidth"):
        get_hardware("h100", hbm_bw=-1.0)


def test_gguf_block_sizes_match_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    for name, (n, nbytes, _) in GGUF_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]] == (n, nbytes), name


@pytest.mark.parametrize("name,bpw", [
    ("q4_0", 4.5), ("q4_1", 5.0), ("q5_0", 5.5), ("q8_0", 8.5), ("q2_k", 2.625), ("q3_k", 3.4375),
    ("q4_k", 4.5), ("q5_k", 5.5), ("q6_k", 6.5625), ("fp16", 16), ("int8-g32", 8.5),
    ("uint4-g128", 4.25), ("int2-g16", 3.0),
])
def test_weight_bits_per_weight(name, bpw):
    assert get_weight_format(name).bits_per_weight == bpw


def test_mix_rules_and_fallbacks():
    m = get_model("llama-3-8b")
    types = {(t.name, t.layer): mix_type("q4_k_m", t, m.layers) for t in m.tensors()}
    assert types[("output", None)] == "q6_k" and types[("token_embd", None)] == "q4_k"
    assert types[("attn_v", 0)] == "q6_k" and types[("attn_v", 4)] == "q4_k" and types[("attn_v", 6)] == "q6_k"
    assert types[("ffn_down", 31)] == "q6_k" and types[("attn_q", 0)] == "q4_k"
    assert types[("attn_norm", 0)] == "f32"
    s = get_model("smollm2-135m")  # rows of 576 are not a multiple of 256: K-quants fall back
    fp = weight_footprint(s, "q4_k_m")["by_type"]
    # tied embedding (= output) and attn_v of 14 layers: q6_k -> q8_0 since 576 % 256 != 0
    assert fp["q8_0"]["params"] == 49152 * 576 + 14 * 192 * 576
    assert "q5_0" in fp  # q4_k rows of 576 -> q5_0
    assert fp["q6_k"]["params"] == 14 * 576 * 1536  # ffn_down rows of 1536 keep q6_k on 14 of 30 layers


def test_int8_per_channel_and_bad_formats():
    m = get_model("llama-3-8b")
    w = weight_footprint(m, "int8")
    assert 8.0 < w["model_bpw"] < 8.01  # one fp16 scale per row of 4096 / 14336
    with pytest.raises(ValueError, match=r"unknown weight format 'int9'; choose one of: fp32, fp16"):
        get_weight_format("int9")


def test_per_transfer_latencies_in_the_lectures_ranges():
    hw = get_hardware("generic-gpu")
    assert 5e-6 <= hw.pcie_latency_s <= 10e-6 and 20e-6 <= hw.nvme_latency_s <= 50e-6
    assert 1500e9 <= hw.hbm_bw <= 3300e9  # "1,500-3,300 GB/s"


def test_weight_format_validation():
    from lessmem.plan import WeightFormat

    with pytest.raises(ValueError, match=r"kind='fixed'; allowed: float, int, gguf, mix"):
        WeightFormat("x", "fixed", 4)
    with pytest.raises(ValueError, match=r"bits=0; allowed: 1 to 32"):
        WeightFormat("x", "int", 0, 32)
    with pytest.raises(ValueError, match=r"gguf_type='q9_k'; allowed"):
        WeightFormat("x", "gguf", 4, gguf_type="q9_k")


def test_budget_above_device_memory_is_flagged():
    from lessmem.plan import plan

    h = plan("llama-3-8b", hardware="l4", context=16384, batch=16, kv="fp8", kv_budget="40GiB")["hybrid"]
    assert any("exceeds the device memory" in s for s in h["suggestions"])
