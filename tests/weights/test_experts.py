"""MoE MLPs (transformers 5's fused 3-D experts) reach every weight method (issue 15)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import lessmem
from lessmem.weights.checkpoint import load_quantized, save_quantized
from lessmem.weights.experts import LinearExperts, fused_expert_params, split_experts
from lessmem.weights.qlinear import QuantLinear

COMMON = dict(vocab_size=272, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "mixtral": lambda: tf.MixtralConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1,
                                        num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           head_dim=64),
}
IDS = torch.randint(3, 270, (2, 40), generator=torch.Generator().manual_seed(0))


def build(arch):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


def expert_bytes(m):
    """Bytes the experts hold: parameters and buffers (a QuantLinear keeps codes in buffers)."""
    return sum(t.numel() * t.element_size() for n, t in (*m.named_parameters(), *m.named_buffers())
               if ".experts." in n)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_split_keeps_the_model_exact(arch):
    m = build(arch)
    before, n_params = logits(m), sum(p.numel() for p in m.parameters())
    assert fused_expert_params(m)  # transformers 5: 3-D expert tensors, not linears
    assert split_experts(m) == COMMON["num_hidden_layers"]
    assert fused_expert_params(m) == [] and split_experts(m) == 0
    experts = m.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == 4
    assert isinstance(experts[3].down_proj, nn.Linear)
    assert sum(p.numel() for p in m.parameters()) == n_params  # the same weights, not copies
    assert torch.allclose(logits(m), before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_rtn_quantizes_the_experts_and_checkpoints_round_trip(arch, tmp_path):
    m = build(arch)
    ref = logits(m)
    float_bytes = expert_bytes(m)
    rep = lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    assert rep["experts_split"] == COMMON["num_hidden_layers"]
    q = [n for n, mod in m.named_modules() if isinstance(mod, QuantLinear) and ".experts." in n]
    assert len(q) == COMMON["num_hidden_layers"] * 4 * 2  # gate_up and down of every expert
    assert expert_bytes(m) < float_bytes / 5  # 4-bit codes and fp16 scales in place of float32
    got = logits(m)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos > 0.95, cos  # close, not equal: 4-bit weights
    assert not torch.equal(got, ref)
    save_quantized(m, tmp_path)
    m2, _ = load_quantized(tmp_path)
    assert torch.equal(logits(m2), got)


def test_skip_patterns_reach_expert_linears():
    m = build("mixtral")
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32, skip=("lm_head", "down_proj")),
                      progress=False)
    ex = m.model.layers[1].mlp.experts[2]
    assert isinstance(ex.gate_up_proj, QuantLinear) and type(ex.down_proj) is nn.Linear


def test_calibrated_method_on_moe_is_a_clear_error_before_any_change():
    m = build("mixtral")
    with pytest.raises(ValueError, match="model_type='mixtral' has no entry for calibrated quantization"):
        lessmem.quantize_(m, lessmem.GPTQConfig(bits=4, group_size=32), calibration=[[5, 6, 7] * 20],
                          progress=False)
    assert fused_expert_params(m)  # untouched


def test_unusual_fused_experts_are_left_with_one_warning():
    """A fused experts module of another kind (here: with biases) is not split; quantize_
    says so once and quantizes everything else."""
    m = build("mixtral")
    for layer in m.model.layers:
        ex = layer.mlp.experts
        ex.gate_up_proj_bias = nn.Parameter(torch.zeros(ex.gate_up_proj.shape[:2]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    msgs = [str(x.message) for x in w if "fused expert tensors" in str(x.message)]
    assert len(msgs) == 1 and "stay in full precision" in msgs[0]
    assert isinstance(m.model.layers[0].self_attn.q_proj, QuantLinear)
