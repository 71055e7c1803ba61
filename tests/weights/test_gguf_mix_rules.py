"""weights.gguf_mix wraps the one rule in base.gguf_rules; GGUFConfig's types and bytes
agree with the planner's footprint, including llama.cpp's 70B attn_v rule."""

from __future__ import annotations

import pytest

import lessmem
from lessmem.base import gguf_rules
from lessmem.models import tiny_random
from lessmem.plan.models import ModelDims
from lessmem.plan.weights import get_weight_format, mix_type, tensor_bytes
from lessmem.weights import gguf_mix
from lessmem.weights.gguf_apply import apply_gguf

HF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
      "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
      "mlp.down_proj": "ffn_down"}


def test_wrapper_is_the_plan_rule():
    for f in gguf_mix.MIXES:
        for name in ("blk.3.attn_v.weight", "blk.3.ffn_down.weight", "output.weight", "blk.0.attn_q.weight"):
            for cols in (256, 768, 4096):
                assert gguf_mix.tensor_type(f, name, cols, 30) == gguf_rules.tensor_type(f, name, cols, 30)
    assert gguf_mix.use_more_bits is gguf_rules.use_more_bits
    assert gguf_mix.FILE_TYPE_IDS["Q4_K_M"] == 15 and gguf_mix.FILE_TYPE_IDS["Q3_K_M"] == 12
    assert gguf_mix.check_mix("q4_k_m") == "Q4_K_M"


def test_wrapper_refuses_types_it_cannot_encode(monkeypatch):
    # a Q3_K row of 576 falls back to Q4_0 (encodable); a type lessmem had no encoder for
    # (IQ4_NL, which older llama.cpp chose there, before lessmem encoded it) and F16 (rows
    # of 48) are refused
    assert gguf_mix.tensor_type("Q3_K_M", "blk.0.attn_q.weight", 576, 30) == "q4_0"
    from lessmem.base import gguf_rules

    monkeypatch.setitem(gguf_rules.FALLBACK, "q3_k", "iq4_nl")
    assert gguf_mix.tensor_type("Q3_K_M", "blk.0.attn_q.weight", 576, 30) == "iq4_nl"
    monkeypatch.setattr(gguf_mix, "ENCODABLE", tuple(t for t in gguf_mix.ENCODABLE if t != "iq4_nl"))
    with pytest.raises(ValueError, match="stores it as iq4_nl in Q3_K_M .row length 576.*cannot encode"):
        gguf_mix.tensor_type("Q3_K_M", "blk.0.attn_q.weight", 576, 30)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="row length 48 is not a multiple of 32"):
        gguf_mix.tensor_type("Q4_0", "blk.0.attn_q.weight", 48, 30)
    with pytest.raises(ValueError, match="GGUF type 'Q7_K' is not supported; allowed: Q4_0"):
        gguf_mix.check_mix("Q7_K")


def _dims(m) -> ModelDims:
    c = m.config
    return ModelDims("tiny", c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                     c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                     c.intermediate_size, c.vocab_size,
                     tied_embeddings=bool(c.tie_word_embeddings))


@pytest.mark.parametrize("ftype,layers,heads,kv", [("Q4_K_M", 8, 4, 4), ("Q3_K_M", 8, 4, 2),
                                                   ("Q4_K_M", 80, 8, 1)])
def test_gguf_config_matches_planner(ftype, layers, heads, kv):
    hidden = 256 if layers < 80 else 64  # 80 layers kept small: rows of 64 take the fallbacks
    m = tiny_random("llama", num_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_heads=heads, num_kv_heads=kv, vocab_size=272)
    rep = apply_gguf(m, lessmem.GGUFConfig(ftype))
    dims = _dims(m)
    fmt = get_weight_format(ftype)
    want_types, want_bytes = {}, 0
    for t in dims.tensors():
        if t.rows == 1 or t.name == "token_embd" and not dims.tied_embeddings:
            continue  # GGUFConfig quantizes the linears (and a tied embedding through lm_head)
        typ = mix_type(ftype.lower(), t, dims.layers, dims.tied_embeddings, heads // kv)
        hf = "lm_head" if t.name in ("output", "token_embd") else \
            f"model.layers.{t.layer}.{next(k for k, v in HF.items() if v == t.name)}"
        want_types[hf] = typ
        want_bytes += tensor_bytes(fmt, t, dims.layers, tied=dims.tied_embeddings, n_gqa=heads // kv)[0]
    assert rep["types"] == want_types
    assert rep["bytes"] == want_bytes
    if layers == 80:  # 70B rule: attn_v Q4_K -> Q5_K, here with its row-64 fallback Q5_1
        v = [rep["types"][f"model.layers.{i}.self_attn.v_proj"] for i in range(80)]
        assert v.count("q5_1") == 40 and v.count("q8_0") == 40  # q6_k -> q8_0 on 40 layers


def test_plan_with_importance_follows_llama_cpp_imatrix_rule():
    """IQ4's first-eighth ffn_down is Q5_K without an importance matrix and stays IQ4 with one
    (given, or measured by GPTQ/AWQ's pass), as llama-quantize chooses; attn_v is Q5_K at 4
    query heads per KV head either way."""
    from lessmem.weights.gguf_apply import gguf_plan
    from lessmem.weights.imatrix import IMatrix

    m = tiny_random("llama", num_layers=8, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=1)
    for mix, base in (("IQ4_XS", "iq4_xs"), ("IQ4_NL", "iq4_nl")):
        plain, gptq, awq, given = ({n: t for n, _, _, t in gguf_plan(m, c)} for c in (
            lessmem.GGUFConfig(mix), lessmem.GGUFConfig(mix, gptq=True), lessmem.GGUFConfig(mix, awq=True),
            lessmem.GGUFConfig(mix, imatrix=IMatrix({}))))
        down0 = "model.layers.0.mlp.down_proj"
        assert plain[down0] == "q5_k" and gptq[down0] == awq[down0] == given[down0] == base
        assert plain["model.layers.1.mlp.down_proj"] == base  # 8 layers: the first eighth is layer 0
        assert plain["model.layers.5.self_attn.v_proj"] == gptq["model.layers.5.self_attn.v_proj"] == "q5_k"
        assert {n: t for n, t in plain.items() if n != down0} == {n: t for n, t in gptq.items() if n != down0}
