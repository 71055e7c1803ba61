"""llama.cpp's GGUF type rules (base.gguf_rules): golden cases, and the planner agreeing with
the exporter's per-tensor types and bytes on a 30-layer and an 80-layer model."""

from __future__ import annotations

from collections import Counter

import pytest

from lessmem.base.gguf_rules import (
    FILE_TYPES,
    check_file_type,
    tensor_type,
    type_bytes,
    use_more_bits,
)
from lessmem.formats.gguf import gguf_type
from lessmem.plan.models import get_model
from lessmem.plan.weights import get_weight_format, mix_type, weight_footprint
from lessmem.weights import gguf_mix

V, D, O, K, Q = "attn_v.weight", "ffn_down.weight", "attn_output.weight", "attn_k.weight", "attn_q.weight"


def t(ftype, role, layer=0, cols=4096, n=32, **kw):
    name = role if role.startswith(("output", "token_embd")) else f"blk.{layer}.{role}"
    return tensor_type(ftype, name, cols, n, **kw)


# (file type, tensor, layer, n_layers, extra, expected) read off llama_tensor_get_type
GOLDEN = [
    ("Q2_K", V, 5, 32, {}, "q3_k"), ("Q2_K", V, 5, 32, {"n_gqa": 4}, "q4_k"),
    ("Q2_K", D, 5, 32, {}, "q3_k"), ("Q2_K", O, 5, 32, {}, "q3_k"), ("Q2_K", Q, 5, 32, {}, "q2_k"),
    ("Q3_K_S", V, 0, 32, {}, "q3_k"), ("Q3_K_S", D, 0, 32, {}, "q3_k"), ("Q3_K_S", O, 0, 32, {}, "q3_k"),
    ("Q3_K_M", V, 1, 32, {}, "q5_k"), ("Q3_K_M", V, 2, 32, {}, "q4_k"),
    ("Q3_K_M", D, 1, 32, {}, "q5_k"), ("Q3_K_M", D, 2, 32, {}, "q4_k"),  # 32 // 16 = 2
    ("Q3_K_M", O, 9, 32, {}, "q4_k"), ("Q3_K_M", Q, 0, 32, {}, "q3_k"),
    ("Q3_K_L", V, 9, 32, {}, "q5_k"), ("Q3_K_L", D, 9, 32, {}, "q5_k"), ("Q3_K_L", O, 9, 32, {}, "q5_k"),
    ("Q4_K_S", V, 3, 32, {}, "q5_k"), ("Q4_K_S", V, 4, 32, {}, "q4_k"),
    ("Q4_K_S", D, 3, 32, {}, "q5_k"), ("Q4_K_S", D, 4, 32, {}, "q4_k"), ("Q4_K_S", O, 0, 32, {}, "q4_k"),
    ("Q4_K_M", V, 0, 32, {}, "q6_k"), ("Q4_K_M", V, 4, 32, {}, "q4_k"), ("Q4_K_M", V, 6, 32, {}, "q6_k"),
    ("Q4_K_M", D, 28, 32, {}, "q6_k"), ("Q4_K_M", D, 26, 32, {}, "q4_k"), ("Q4_K_M", D, 27, 32, {}, "q6_k"), ("Q4_K_M", O, 0, 32, {}, "q4_k"),
    ("Q5_K_S", V, 0, 32, {}, "q5_k"), ("Q5_K_S", D, 0, 32, {}, "q5_k"),
    ("Q5_K_M", V, 0, 32, {}, "q6_k"), ("Q5_K_M", D, 4, 32, {}, "q5_k"), ("Q5_K_M", D, 31, 32, {}, "q6_k"),
    ("Q6_K", V, 0, 32, {}, "q6_k"), ("Q6_K", D, 0, 32, {}, "q6_k"),
    ("Q4_0", V, 0, 32, {}, "q4_0"), ("Q4_0", D, 0, 32, {}, "q4_0"), ("Q8_0", V, 0, 32, {}, "q8_0"),
    # 70B (80 layers, grouped KV heads): attn_v Q3_K/Q4_K -> Q5_K; not without GQA (65B)
    ("Q4_K_M", V, 11, 80, {"n_gqa": 8}, "q5_k"), ("Q4_K_M", V, 0, 80, {"n_gqa": 8}, "q6_k"),
    ("Q3_K_M", V, 5, 80, {"n_gqa": 8}, "q5_k"), ("Q2_K", V, 5, 80, {"n_gqa": 8}, "q5_k"),
    ("Q4_K_M", V, 11, 80, {}, "q4_k"), ("Q4_K_M", D, 11, 80, {"n_gqa": 8}, "q4_k"),
    ("Q4_K_S", V, 9, 80, {"n_gqa": 8}, "q5_k"), ("Q5_K_S", V, 9, 80, {"n_gqa": 8}, "q5_k"),
    # 8 experts: attn_v and attn_k in Q8_0, attn_output Q5_K for the low mixes
    ("Q4_K_M", V, 4, 32, {"n_expert": 8}, "q8_0"), ("Q4_K_S", K, 4, 32, {"n_expert": 8}, "q8_0"),
    ("Q3_K_M", O, 4, 32, {"n_expert": 8}, "q5_k"), ("Q6_K", O, 4, 32, {"n_expert": 8}, "q6_k"),
    # fused qkv
    ("Q4_K_M", "attn_qkv.weight", 4, 32, {}, "q5_k"), ("Q5_K_M", "attn_qkv.weight", 4, 32, {}, "q6_k"),
    ("Q3_K_L", "attn_qkv.weight", 4, 32, {}, "q4_k"),
]


@pytest.mark.parametrize("ftype,role,layer,n,kw,want", GOLDEN)
def test_golden_llama_cpp_rules(ftype, role, layer, n, kw, want):
    assert t(ftype, role, layer, 4096, n, **kw) == want


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_output_and_embeddings(ftype):
    base = FILE_TYPES[ftype][0]
    out = "q8_0" if base == "q8_0" else "q6_k"
    assert t(ftype, "output.weight") == out
    assert t(ftype, "token_embd.weight") == base  # untied: the base type
    assert t(ftype, "token_embd.weight", has_output=False) == out  # tied: it is the output
    assert t(ftype, "output_norm.weight", ndim=1) == "f32"


def test_row_length_fallbacks():
    # K-quants need rows of 256: Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0, Q2_K/Q3_K->Q4_0, then F16
    assert t("Q4_K_M", Q, cols=576) == "q5_0" and t("Q4_K_M", V, 0, cols=576) == "q8_0"
    assert t("Q5_K_S", Q, cols=576) == "q5_1" and t("Q6_K", Q, cols=576) == "q8_0"
    assert t("Q3_K_M", Q, cols=576) == "q4_0" and t("Q2_K", Q, cols=576) == "q4_0"
    assert t("Q4_0", Q, cols=48) == "f16" and t("Q4_K_M", Q, cols=48) == "f16"
    # the output's Q8_0 comes from the base block not dividing the row
    assert t("Q4_K_M", "output.weight", cols=576) == "q8_0" and t("Q4_0", "output.weight", cols=576) == "q8_0"


def test_use_more_bits_counts():
    assert sum(use_more_bits(i, 30) for i in range(30)) == 14
    assert sum(use_more_bits(i, 80) for i in range(80)) == 40
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_bad_file_type():
    with pytest.raises(ValueError, match="GGUF type 'Q7_K' is not supported; allowed: Q4_0"):
        check_file_type("Q7_K")
    with pytest.raises(ValueError, match="GGUF type 'q9' is not supported"):
        tensor_type("q9", "output.weight", 256, 2)
    with pytest.raises(ValueError, match="GGUF type 'q4_x'; allowed: f32"):
        type_bytes("q4_x", 1, 32)


def exporter_types(m, ftype) -> dict:
    """Per-type params, as the exporter / GGUFConfig name and type the tensors."""
    n_gqa = m.heads // m.kv_heads
    hd = m.hidden // m.heads
    q, kv = m.heads * hd, m.kv_heads * hd
    shapes = {"self_attn.q_proj": (q, m.hidden), "self_attn.k_proj": (kv, m.hidden),
              "self_attn.v_proj": (kv, m.hidden), "self_attn.o_proj": (m.hidden, q),
              "mlp.gate_proj": (m.intermediate, m.hidden), "mlp.up_proj": (m.intermediate, m.hidden),
              "mlp.down_proj": (m.hidden, m.intermediate)}
    tensors = [(f"model.layers.{i}.{k}", s) for i in range(m.layers) for k, s in shapes.items()]
    tensors.append(("lm_head", (m.vocab, m.hidden)))
    out = Counter()
    for hf, (rows, cols) in tensors:
        g = gguf_mix.gguf_name(hf)
        if g == "output.weight" and m.tied_embeddings:
            g = "token_embd.weight"
        typ = gguf_mix.tensor_type(ftype, g, cols, m.layers, has_output=not m.tied_embeddings, n_gqa=n_gqa)
        out[typ] += rows * cols
    if not m.tied_embeddings:
        out[gguf_mix.tensor_type(ftype, "token_embd.weight", m.hidden, m.layers, n_gqa=n_gqa)] += m.vocab * m.hidden
    return out


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3-70b"])
@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_planner_matches_exporter(model, ftype):
    m = get_model(model)
    fp = weight_footprint(m, ftype)["by_type"]
    planned = {k: v["params"] for k, v in fp.items() if k != "f32"}  # f32: the norms
    exported = exporter_types(m, ftype)  # every mix of both models is encodable
    assert planned == dict(exported)
    # bytes: the planner's block table against the encoder's layout
    planned_bytes = sum(v["bytes"] for k, v in fp.items() if k != "f32")
    enc = sum(p // gguf_type(k).block_size * gguf_type(k).type_size for k, p in exported.items())
    assert planned_bytes == enc


def test_70b_q4_k_m_attn_v_and_bpw():
    m = get_model("llama-3-70b")
    types = Counter(mix_type("q4_k_m", x, m.layers, n_gqa=8) for x in m.tensors() if x.name == "attn_v")
    assert types == {"q6_k": 40, "q5_k": 40}
    # llama.cpp's 70B Q4_K_M lands near 4.8-4.9 bits per weight
    assert 4.75 < weight_footprint(m, "Q4_K_M")["model_bpw"] < 4.95


def test_file_types_size_their_output():
    # a Q4_0 file stores the output matrix in Q6_K (llama-quantize without --pure)
    m = get_model("llama-2-7b")
    fp = weight_footprint(m, "q4_0")["by_type"]
    assert fp["q6_k"]["params"] == 32000 * 4096
    assert get_weight_format("q4_0").bits_per_weight == 4.5
    # q4_k is a tensor type, not a file type: the same type everywhere
    assert set(weight_footprint(m, "q4_k")["by_type"]) == {"q4_k", "f32"}
