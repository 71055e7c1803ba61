"""GGUF export (read back by the gguf package) and the llama.cpp mix rules."""

import gguf
import numpy as np
import pytest
import torch

import lessmem
from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
from lessmem.models import tiny_random
from lessmem.weights.gguf_export import export_gguf
from lessmem.weights.gguf_mix import tensor_type, use_more_bits

N_LAYERS = 8


def _source(path):
    """A small llama-shaped GGUF with f32 / Q8_0 tensors and tokenizer metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(N_LAYERS)
    w.add_embedding_length(256)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 256), dtype=np.float32))
    for i in range(N_LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(256, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_v.weight", rng.standard_normal((64, 256), dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((32, 96), dtype=np.float32))
        down = rng.standard_normal((32, 512), dtype=np.float32)
        w.add_tensor(f"blk.{i}.ffn_down.weight", quantize_gguf(down, "q8_0"),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output.weight", rng.standard_normal((3, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_export_reads_back_with_matching_tensors(tmp_path):
    src, out = tmp_path / "src.gguf", tmp_path / "out.gguf"
    _source(src)
    rep = export_gguf(src, out, "Q4_K_M", progress=False)
    r_src, r_out = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    assert r_out.fields["general.file_type"].contents() == 15
    assert r_out.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert r_out.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert r_out.fields["llama.block_count"].contents() == N_LAYERS
    by_name = {t.name: t for t in r_src.tensors}
    assert [t.name for t in r_out.tensors] == list(by_name)
    for t in r_out.tensors:
        s = by_name[t.name]
        shape = [int(v) for v in reversed(list(s.shape))]
        x = gguf.quants.dequantize(s.data, s.tensor_type).reshape(shape)
        typ = t.tensor_type.name.lower()
        assert typ == tensor_type("Q4_K_M", t.name, shape[-1], N_LAYERS, ndim=len(shape))
        y = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if typ == "f32":
            assert np.array_equal(x, y)
        else:  # the file holds exactly our encoder's bytes, and gguf decodes them as we do
            assert np.array_equal(np.asarray(t.data).reshape(-1), quantize_gguf(x, typ).reshape(-1))
            ours = dequantize_gguf(quantize_gguf(x, typ), typ, shape).numpy()
            assert np.array_equal(y, ours)
    types = {t.name: t.tensor_type.name for t in r_out.tensors}
    assert types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.2.attn_v.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # 96 columns: no K-quant super-blocks
    assert types["blk.3.ffn_down.weight"] == "Q6_K"  # use_more_bits(3, 8): (3 - 1) % 3 == 2
    assert rep["tensors"]["q6_k"] == sum(v == "Q6_K" for v in types.values())


def test_mix_rules_table():
    assert [use_more_bits(i, 32) for i in (0, 3, 4, 5, 6, 7, 28, 31)] == \
        [True, True, False, False, True, False, True, True]
    assert tensor_type("Q4_K_S", "blk.2.attn_v.weight", 512, 32) == "q5_k"
    assert tensor_type("Q4_K_S", "blk.5.attn_v.weight", 512, 32) == "q4_k"
    assert tensor_type("Q8_0", "output.weight", 512, 32) == "q8_0"
    assert tensor_type("Q4_0", "output.weight", 512, 32) == "q6_k"
    assert tensor_type("Q6_K", "token_embd.weight", 576, 30, has_output=False) == "q8_0"
    assert tensor_type("Q4_0", "blk.0.ffn_up.weight", 576, 30) == "q4_0"
    assert tensor_type("Q4_K_M", "blk.0.attn_norm.weight", 576, 30, ndim=1) == "f32"


def test_bad_gguf_inputs(tmp_path):
    with pytest.raises(ValueError, match="GGUF type 'Q7_K' is not supported; allowed: Q4_0"):
        export_gguf(tmp_path / "x.gguf", tmp_path / "y.gguf", "Q7_K")
    with pytest.raises(ValueError, match="needs a source .gguf file"):
        export_gguf(tmp_path / "missing.gguf", tmp_path / "y.gguf", "Q4_K_M")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        tensor_type("Q4_0", "blk.0.attn_q.weight", 48, 4)


def test_gguf_config_in_memory():
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    w0 = m.model.layers[0].mlp.up_proj.weight.detach().clone()
    rep = lessmem.quantize_(m, lessmem.GGUFConfig("Q4_0"))
    assert rep["types"]["lm_head"] == "q6_k" and rep["types"]["model.layers.0.mlp.up_proj"] == "q4_0"
    w1 = m.model.layers[0].mlp.up_proj.weight.detach()
    expect = dequantize_gguf(quantize_gguf(w0, "q4_0"), "q4_0", tuple(w0.shape))
    assert torch.equal(w1, expect)
    assert 4.5 < rep["bits_per_weight"] < 6.6
