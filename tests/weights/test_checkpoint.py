"""save_quantized / load_quantized round trip: identical logits."""

import json

import pytest
import torch

import lessmem
from lessmem.models import tiny_random
from lessmem.weights.checkpoint import load_quantized


@pytest.mark.parametrize("cfg", [
    lessmem.RTNConfig(bits=4, group_size=32),
    lessmem.RTNConfig(bits=3, group_size=64, symmetric=True,
                      overrides={"*.down_proj": {"bits": 8, "group_size": None, "symmetric": True}}),
    lessmem.RTNConfig(bits=2, group_size=None),
])
def test_roundtrip_same_logits(tmp_path, cfg):
    m = tiny_random("llama")
    lessmem.quantize_(m, cfg, progress=False)
    lessmem.save_quantized(m, tmp_path)
    meta = json.loads((tmp_path / "lessmem_quant.json").read_text())
    assert meta["quantization"]["bits"] == cfg.bits
    m2, tok = load_quantized(tmp_path)
    assert tok is None
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_roundtrip_w8a8_and_tokenizer_via_lessmem_load(tmp_path):
    from lessmem.models import tiny_tokenizer

    m = tiny_random("llama")
    lessmem.quantize_(m, lessmem.SmoothQuantConfig(n_samples=2, seq_len=32),
                      calibration=torch.randint(0, 256, (64,)), progress=False)
    lessmem.save_quantized(m, tmp_path, tokenizer=tiny_tokenizer())
    m2, tok = lessmem.load(str(tmp_path))
    assert tok("héllo")["input_ids"] == tiny_tokenizer()("héllo")["input_ids"]
    x = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="holds no lessmem_quant.json"):
        load_quantized(tmp_path)
    (tmp_path / "lessmem_quant.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format='other'"):
        load_quantized(tmp_path)


def test_tied_embeddings_stored_once(tmp_path):
    from safetensors.torch import load_file

    m = tiny_random("llama")
    m.config.tie_word_embeddings = True
    m.lm_head.weight = m.model.embed_tokens.weight
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    lessmem.save_quantized(m, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    m2, _ = load_quantized(tmp_path)
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_bf16_model_roundtrip_same_logits(tmp_path):
    m = tiny_random("llama", dtype=torch.bfloat16)  # rotary inv_freq is bf16 too (model.to)
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    lessmem.save_quantized(m, tmp_path)
    m2, _ = load_quantized(tmp_path)
    assert m2.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    assert m2.model.embed_tokens.weight.dtype == torch.bfloat16
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_checkpoint_without_buffer_dtypes_still_loads(tmp_path):
    m = tiny_random("llama")
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    lessmem.save_quantized(m, tmp_path)
    p = tmp_path / "lessmem_quant.json"
    meta = json.loads(p.read_text())
    del meta["buffer_dtypes"]  # as written before the field existed
    p.write_text(json.dumps(meta))
    m2, _ = load_quantized(tmp_path)
    x = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)
