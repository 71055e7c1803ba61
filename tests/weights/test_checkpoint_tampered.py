"""A damaged or tampered lessmem checkpoint is refused with one clear ValueError, before
anything named in it is called, set or allocated; loading builds no float model."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import lessmem
from lessmem.models import tiny_random
from lessmem.weights import checkpoint
from lessmem.weights.checkpoint import load_quantized, parameters_on_meta

BAD = "not a valid lessmem checkpoint"
Q = "model.layers.0.mlp.down_proj"  # a quantized linear: in 128, out 64, group 32


@pytest.fixture
def ckpt(tmp_path):
    m = tiny_random("llama")
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    lessmem.save_quantized(m, tmp_path)
    return tmp_path


def _edit_meta(d, change):
    p = d / "lessmem_quant.json"
    meta = json.loads(p.read_text())
    change(meta)
    p.write_text(json.dumps(meta))


def _set(path, value):
    def change(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _delete(*path):
    def change(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


def _add_module(name, **fields):
    spec = {"bits": 4, "group_size": 32, "symmetric": False, "act_bits": None,
            "in_features": 128, "out_features": 64, "bias": False}
    spec.update(fields)
    return _set(("modules", name), spec)


# (what is tampered, the change, words the error must contain)
META_CASES = [
    ("a function named as the class", _set(("architecture",), "pipeline"), "not a model class"),
    ("a config class named as the model", _set(("architecture",), "LlamaConfig"), "not a model class"),
    ("a dunder name", _set(("architecture",), "__class__"), "not a class name"),
    ("a dotted name", _set(("architecture",), "models.llama"), "not a class name"),
    ("an unknown name", _set(("architecture",), "NoSuchModelForCausalLM"), "not a transformers model"),
    ("a model of another config", _set(("architecture",), "BertModel"), "takes a BertConfig"),
    ("an attribute path as module", _add_module("__class__.injected"), "no module"),
    ("a module path that does not exist", _add_module("model.layers.9.mlp.down_proj"), "no module"),
    ("a module that is not a linear", _add_module("model.layers.0.mlp"), "not a linear layer"),
    ("a 65536 x 65536 entry", _set(("modules", Q, "in_features"), 65536), "the model's layer is 64 x 128"),
    ("both sizes 65536", lambda m: m["modules"][Q].update(in_features=65536, out_features=65536),
     "the model's layer is 64 x 128"),
    ("bits as a string", _set(("modules", Q, "bits"), "4"), "wrong type"),
    ("bits not allowed", _set(("modules", Q, "bits"), 5), "allowed: 2, 3, 4, 8"),
    ("bias flag as int", _set(("modules", Q, "bias"), 0), "wrong type"),
    ("group size zero", _set(("modules", Q, "group_size"), 0), "does not divide"),
    ("group size not dividing", _set(("modules", Q, "group_size"), 48), "does not divide"),
    ("a field missing", _delete("modules", Q, "bits"), "exactly the fields"),
    ("act_bits with 4 bits", _set(("modules", Q, "act_bits"), 8), "act_bits"),
    ("modules entry a list", _set(("modules", Q), [1, 2]), "exactly the fields"),
    ("modules a list", _set(("modules",), []), "module name -> fields"),
    ("modules missing", _delete("modules"), "which the model does not have"),
    ("model_config missing", _delete("model_config"), "model_type"),
    ("model_type unknown", _set(("model_config", "model_type"), "nope"), "not a valid 'nope' config"),
    ("a config field of the wrong type", _set(("model_config", "hidden_size"), "x"), "config"),
    ("a config of another size", _set(("model_config", "hidden_size"), 128), "the model's layer is"),
    # a real buffer of 2^50 floats (rotary inv_freq) if built before the sizes were checked
    ("a head_dim sized to exhaust memory", _set(("model_config", "head_dim"), 2**51), "the model's layer is"),
    ("a million layers", _set(("model_config", "num_hidden_layers"), 10**6), "num_hidden_layers=1000000"),
    ("a config the class cannot build", _set(("model_config", "num_attention_heads"), 0), "config"),
    ("tied to a missing tensor", _set(("tied",), {"lm_head.weight": "nope.weight"}), "tied entry"),
    ("tied not an object", _set(("tied",), ["a"]), "tied must map"),
    ("quantization not an object", _set(("quantization",), 3), "quantization must be"),
    ("version 2", _set(("version",), 2), "version=2"),
    ("a buffer dtype not allowed", _set(("buffer_dtypes",), {"model.rotary_emb.inv_freq": "int8"}),
     "buffer_dtypes must map"),
    ("a buffer dtype for a stored tensor", _set(("buffer_dtypes",), {"model.norm.weight": "float16"}),
     "not buffers the model computes itself"),
]


@pytest.mark.parametrize("what,change,words", META_CASES, ids=[c[0] for c in META_CASES])
def test_tampered_meta_is_refused(ckpt, monkeypatch, what, change, words):
    called = []
    monkeypatch.setattr(transformers, "pipeline", lambda *a, **k: called.append(a))
    monkeypatch.setattr(checkpoint, "unpack_bits", lambda *a, **k: called.append("unpack"))
    _edit_meta(ckpt, change)
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(ckpt)
    assert words in str(e.value) and str(ckpt) in str(e.value)
    assert called == []  # nothing named in the file ran, no codes were unpacked (allocated)
    assert not hasattr(type(transformers.LlamaForCausalLM), "injected")
    assert not hasattr(transformers.LlamaForCausalLM, "injected")


@pytest.mark.parametrize("text,words", [
    ('{"format": "lessmem-quant", "version": 1', "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "the top level is a list"),
    ('"lessmem"', "the top level is a str"),
])
def test_damaged_json(ckpt, text, words):
    (ckpt / "lessmem_quant.json").write_text(text)
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(ckpt)
    assert words in str(e.value)


def test_json_not_utf8(ckpt):
    (ckpt / "lessmem_quant.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_quantized(ckpt)


def _edit_tensors(d, change):
    t = load_file(str(d / "model.safetensors"))
    change(t)
    save_file(t, str(d / "model.safetensors"))


TENSOR_CASES = [
    ("scale of the wrong shape", lambda t: t.update({f"{Q}.scale": torch.zeros(64, 5, dtype=torch.float16)}),
     f"tensor '{Q}.scale' is torch.float16 [64, 5]"),
    ("codes of the wrong size", lambda t: t.update({f"{Q}.qweight": torch.zeros(7, dtype=torch.uint8)}),
     "the model needs torch.uint8 [4096]"),
    ("codes as float", lambda t: t.update({f"{Q}.qweight": torch.zeros(4096)}), "torch.float32 [4096]"),
    ("embeddings of another size", lambda t: t.update({"model.embed_tokens.weight": torch.zeros(10, 64)}),
     "model.embed_tokens.weight"),
    ("a tensor missing", lambda t: t.pop("model.norm.weight"), "lacks ['model.norm.weight']"),
    ("a stray tensor", lambda t: t.update({"__class__.x": torch.zeros(1)}), "does not have"),
]


@pytest.mark.parametrize("what,change,words", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_tampered_tensors_are_refused(ckpt, monkeypatch, what, change, words):
    monkeypatch.setattr(checkpoint, "unpack_bits", lambda *a, **k: pytest.fail("unpacked"))
    _edit_tensors(ckpt, change)
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(ckpt)
    assert words in str(e.value)


@pytest.mark.parametrize("cut", [0, 7, 100, -10])
def test_truncated_tensor_file(ckpt, cut):
    p = ckpt / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=BAD):
        load_quantized(ckpt)


def test_missing_tensor_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_quantized(ckpt)


def test_tampered_gguf_entry(tmp_path):
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    lessmem.quantize_(m, lessmem.GGUFConfig("Q8_0"))
    lessmem.save_quantized(m, tmp_path)
    name = next(iter(json.loads((tmp_path / "lessmem_quant.json").read_text())["gguf_modules"]))
    _edit_meta(tmp_path, _set(("gguf_modules", name, "gguf_type"), "q9_z"))
    with pytest.raises(ValueError, match=BAD) as e:
        load_quantized(tmp_path)
    assert "q9_z" in str(e.value).lower()
    _edit_meta(tmp_path, _set(("gguf_modules", name, "gguf_type"), "q4_0"))  # valid type, wrong bytes
    with pytest.raises(ValueError, match="the model needs torch.uint8"):
        load_quantized(tmp_path)


def test_parameters_on_meta_keeps_buffers_real():
    with parameters_on_meta():
        lin = torch.nn.Linear(4096, 4096)
        m = tiny_random("llama")
    assert lin.weight.is_meta and lin.bias.is_meta
    assert all(p.is_meta for p in m.parameters())
    assert not any(b.is_meta for b in m.buffers())  # rotary inv_freq computed for real
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the hook is gone afterwards


def test_loaded_model_has_no_meta_tensors_and_same_buffers(ckpt):
    src = tiny_random("llama")
    m2, _ = load_quantized(ckpt)
    assert not any(t.is_meta for t in [*m2.parameters(), *m2.buffers()])
    for name, b in src.named_buffers():
        assert torch.equal(b, m2.get_buffer(name)), name


def test_tied_weights_are_one_parameter_after_loading(tmp_path):
    m = tiny_random("llama")
    m.config.tie_word_embeddings = True
    m.lm_head.weight = m.model.embed_tokens.weight
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    lessmem.save_quantized(m, tmp_path)
    m2, _ = load_quantized(tmp_path)
    assert m2.lm_head.weight is m2.model.embed_tokens.weight  # one Parameter, as in the source
    x = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)
