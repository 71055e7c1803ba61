"""save_quantized / lessmem.load round trip of GGUFLinear layers: identical logits."""

import json

import pytest
import torch
from safetensors.torch import load_file

import lessmem
from lessmem.models import tiny_random
from lessmem.weights.gguf_linear import GGUFLinear


@pytest.mark.parametrize("arch,mix", [("llama", "Q4_K_M"), ("qwen2", "Q8_0"), ("llama", "Q4_0")])
def test_gguf_roundtrip_same_logits(tmp_path, arch, mix):
    m = tiny_random(arch, hidden_size=256, intermediate_size=512, num_heads=4).eval()
    rep = lessmem.quantize_(m, lessmem.GGUFConfig(mix))
    lessmem.save_quantized(m, tmp_path)
    meta = json.loads((tmp_path / "lessmem_quant.json").read_text())
    assert meta["quantization"]["type"] == mix
    assert {n: s["gguf_type"] for n, s in meta["gguf_modules"].items()} == rep["types"]
    stored = load_file(str(tmp_path / "model.safetensors"))
    q = m.model.layers[1].mlp.down_proj
    assert torch.equal(stored["model.layers.1.mlp.down_proj.qweight"], q.qweight)  # the raw blocks
    m2, tok = lessmem.load(str(tmp_path))
    assert tok is None
    held = [mod for mod in m2.modules() if isinstance(mod, GGUFLinear)]
    assert len(held) == len(rep["types"]) and sum(h.nbytes for h in held) == rep["bytes_held"]
    if arch == "qwen2":  # q/k/v biases travel with the blocks
        assert torch.equal(m2.model.layers[0].self_attn.q_proj.bias, m.model.layers[0].self_attn.q_proj.bias)
    for ids in (torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (2, 20))):  # fused and BLAS paths
        with torch.no_grad():
            assert torch.equal(m(ids).logits, m2(ids).logits)
