"""Loading a GGUF file as stored: every linear a GGUFLinear over the mapped file, the
embedding decoded per row, a tied lm_head over the same blocks; logits equal to the same
model with the decoded weights; the built-in model without inflating it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lessmem
from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
from lessmem.models import tiny_random
from lessmem.serve import Engine, EngineConfig, SamplingParams
from lessmem.weights import gguf_linear
from lessmem.weights.gguf_export import write_model_gguf
from lessmem.weights.gguf_linear import GGUFLinear, set_int8_activations
from lessmem.weights.gguf_load import GGUFEmbedding, hf_name, load_gguf_blocks, permute_rows


def _decoded_twin(model, qtype):
    """``model`` with each linear and the embedding replaced by its GGUF round trip (floats)."""
    done = set()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)) and id(mod.weight) not in done:
                done.add(id(mod.weight))  # a tied weight is encoded once
                raw = quantize_gguf(mod.weight, qtype)
                mod.weight.copy_(dequantize_gguf(raw, qtype, tuple(mod.weight.shape)))
    return model


def _tied(model):
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("arch,qtype,tied", [("llama", "q8_0", False), ("llama", "q4_k", True),
                                             ("qwen2", "q4_0", False), ("mistral", "q6_k", True)])
def test_blocks_model_equals_its_decoded_twin(tmp_path, arch, qtype, tied):
    torch.manual_seed(0)
    m = tiny_random(arch, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    if tied:
        m = _tied(m)
    path = write_model_gguf(m, tmp_path / "m.gguf", qtype)
    g = load_gguf_blocks(path, config=m.config, int8_activations=False)
    twin = _decoded_twin(m, qtype)
    assert not [n for n, x in g.named_modules() if type(x) in (nn.Linear, nn.Embedding)]
    assert isinstance(g.model.embed_tokens, GGUFEmbedding)
    ids = torch.randint(0, 272, (1, 40))
    with torch.no_grad():
        ref, got = twin(ids).logits, g(ids).logits  # 40 rows: decode the weight, BLAS
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
        ref1, got1 = twin(ids[:, :5]).logits, g(ids[:, :5]).logits  # 5 rows: the fused kernel
        assert torch.allclose(got1, ref1, atol=1e-4, rtol=1e-4), (got1 - ref1).abs().max()
        set_int8_activations(g, True)  # the default: decode rows multiply int8 activations
        got8 = g(ids[:, :5]).logits
        got_p = g(ids).logits  # prefill rows: float32, or bf16 where the CPU has AMX-BF16
    if gguf_linear.BF16_PROMPT_ROWS:
        assert 0 < (got_p - got).abs().max() <= 0.05 * got.abs().max()
    else:
        assert torch.equal(got_p, got)
    assert 0 < (got8 - ref1).abs().max() <= 0.05 * ref1.abs().max()
    if tied:  # the lm_head reads the embedding's own blocks: held once
        assert g.lm_head.qweight.data_ptr() == g.model.embed_tokens.qweight.data_ptr()


def test_float_weights_keep_transformers_row_order(tmp_path):
    """An F32 file: llama.cpp stores q/k rows in its rotary order for float tensors too;
    they are put back (they were left permuted, logits off by ~0.08 of 1.2)."""
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = write_model_gguf(m, tmp_path / "x.gguf", "f32")
    g = load_gguf_blocks(path, config=m.config)
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(g(ids).logits, m(ids).logits)


def test_linears_view_the_mapped_file(tmp_path):
    m = tiny_random("qwen2", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = write_model_gguf(m, tmp_path / "m.gguf", "q8_0")
    g = load_gguf_blocks(path, config=m.config)
    rep = g._lessmem_gguf
    blocks = [x for x in g.modules() if isinstance(x, GGUFLinear)]
    base = {x.qweight.untyped_storage().data_ptr() for x in blocks}
    assert len(base) == 1  # one mapping of the file, viewed by every layer (qwen2: no q/k reorder)
    assert rep["bytes_mapped"] == sum(x.qweight.numel() for x in blocks) + g.model.embed_tokens.qweight.numel()
    assert rep["inflated"] == [] and rep["types"]["model.layers.0.mlp.down_proj"] == "q8_0"
    assert rep["bytes_mapped"] < path.stat().st_size


def test_llama_qk_rows_stay_mapped_and_outputs_come_in_transformers_order(tmp_path):
    """llama.cpp's q/k rows (its rotary order) are viewed in the mapping like every other
    linear; the layer gathers its outputs (``out_perm``) instead of copying the rows, and
    everything seen from outside (outputs, ``weight``, ``state_dict``) is in transformers' order."""
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = write_model_gguf(m, tmp_path / "m.gguf", "q8_0")
    g = load_gguf_blocks(path, config=m.config)
    blocks = [x for x in g.modules() if isinstance(x, GGUFLinear)]
    assert len({x.qweight.untyped_storage().data_ptr() for x in blocks}) == 1
    assert g._lessmem_gguf["bytes_mapped"] == sum(x.qweight.numel() for x in blocks) + g.model.embed_tokens.qweight.numel()
    q = g.model.layers[0].self_attn.q_proj
    assert q.out_perm is not None and g.model.layers[0].mlp.up_proj.out_perm is None
    plain = GGUFLinear(q.in_features, q.out_features, "q8_0", False, int8_activations=q.int8_activations)
    plain.load_state_dict(q.state_dict())  # saved in output order: a plain layer computes the same
    assert plain.out_perm is None and torch.equal(plain.weight, q.weight)
    x = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain(x), q(x))  # decode rows: the fused kernel, row by row
    xs = torch.randn(200, q.in_features, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(plain(xs), q(xs), atol=1e-5)  # prefill rows: decoded + BLAS
    assert torch.equal(q.rows_in_output_order(), plain.qweight)
    q.load_state_dict(plain.state_dict())  # loaded back in its own row order: the gather still holds
    assert q.out_perm is not None and torch.equal(q(x), plain(x))
    with pytest.raises(ValueError, match="permutation of range"):
        GGUFLinear(q.in_features, q.out_features, "q8_0", False, out_perm=torch.zeros(q.out_features, dtype=torch.long))


def test_permute_rows_round_trips_and_names_map_back():
    w = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(permute_rows(permute_rows(w, 2, inverse=False), 2), w)
    assert not torch.equal(permute_rows(w, 2), w)
    assert hf_name("blk.2.attn_output.weight") == "model.layers.2.self_attn.o_proj.weight"


def test_bad_files_and_ids_are_refused_clearly(tmp_path):
    import gguf

    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not loaded as GGUF blocks"):
        load_gguf_blocks(p)
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = write_model_gguf(m, tmp_path / "m.gguf", "q8_0")
    bigger = type(m.config)(**{**m.config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="no tensor for model.layers.2"):
        load_gguf_blocks(path, config=bigger)
    g = load_gguf_blocks(path, config=m.config)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 272\)"):
        g(torch.tensor([[1, 272]]))
    with pytest.raises(ValueError, match="weights='float'"):
        lessmem.quantize_(g, lessmem.RTNConfig(bits=4))
    with pytest.raises(ValueError, match="weights='blocks'; allowed: 'stored', 'float'"):
        lessmem.load(str(path), weights="blocks")


def test_prefill_decodes_a_large_weight_in_slices(monkeypatch):
    import lessmem.weights.gguf_linear as gl

    lin = nn.Linear(256, 96)
    q = GGUFLinear.from_linear(lin, "q8_0")
    x = torch.randn(40, 256)
    whole = q(x)
    monkeypatch.setattr(gl, "DECODE_WEIGHTS_MAX", 256 * 32)  # 3 slices of 32 output rows
    assert torch.allclose(q(x), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_prompt_rows_with_reduced_precision_activations_multiply_in_bf16(monkeypatch, bias):
    """Prompt rows (more than FUSED_MAX_ROWS) of a layer with int8_activations multiply bf16
    copies of x and the decoded weight where BF16_PROMPT_ROWS (AMX-BF16 or AVX512-BF16);
    float32 otherwise."""
    gl = gguf_linear
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=bias)
    q = GGUFLinear.from_linear(lin, "q4_1")
    w = q.dequantized_weight()
    b = None if q.bias is None else q.bias.float()
    x = torch.randn(40, 256)
    fp32 = torch.nn.functional.linear(x, w, b)
    bf16 = (x.bfloat16().double() @ w.bfloat16().double().t()).float()
    bf16 = bf16 if b is None else bf16 + b

    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", True)
    monkeypatch.setattr(gl, "DECODE_WEIGHTS_MAX", 256 * 32)  # in slices of 32 output rows, too
    assert torch.allclose(q(x), fp32, atol=1e-5, rtol=0)  # the flag off: float32
    q.int8_activations = True
    y = q(x)
    scale = fp32.abs().max()
    assert (y - bf16).abs().max() <= 2 ** -7 * scale  # sums in float32, the product rounded to bf16
    assert (y - fp32).abs().max() > 1e-4 * scale  # and it is not the float32 product
    # decode rows keep the fused int8 kernel
    assert torch.equal(q(x[:16]), gl._GGUF(x[:16], q.qweight, q._type.ggml_id, 96, q.bias, True))
    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", False)
    assert torch.allclose(q(x), fp32, atol=1e-5, rtol=0)  # no AMX-BF16: float32


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_into_writes_the_forward_outputs(monkeypatch, bf16, bias):
    """``forward_into`` (the serving row plan's prompt chunks) writes exactly ``forward``'s
    outputs into a part of a larger float32 output, in one piece and in slices of the weight,
    and declines (False, ``out`` untouched) rows the fused kernel takes and permuted outputs."""
    gl = gguf_linear
    torch.manual_seed(0)
    q = GGUFLinear.from_linear(nn.Linear(256, 96, bias=bias), "q4_1")
    q.int8_activations = True
    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", bf16)
    x = torch.randn(40, 256)
    for slices in (False, True):
        if slices:
            monkeypatch.setattr(gl, "DECODE_WEIGHTS_MAX", 256 * 32)  # 3 slices of 32 output rows
        out = torch.full((50, 96), float("nan"))
        assert q.forward_into(x, out[5:45])
        assert torch.equal(out[5:45], q(x)) and out[:5].isnan().all() and out[45:].isnan().all()
    out = torch.full((16, 96), float("nan"))
    assert not q.forward_into(x[:16], out) and out.isnan().all()  # decode rows: the fused kernel's
    q.out_perm = torch.arange(95, -1, -1)
    assert not q.forward_into(x, torch.empty(40, 96))


def test_bf16_prompt_rows_follow_the_cpu():
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo")
    assert gguf_linear.BF16_PROMPT_ROWS == ("amx_bf16" in flags or "avx512_bf16" in flags)


def test_engine_on_blocks_is_batch_invariant(tmp_path):
    torch.manual_seed(0)
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    g = load_gguf_blocks(write_model_gguf(m, tmp_path / "m.gguf", "q4_k"), config=m.config)
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 256, (150 + 7 * i,), generator=gen).tolist() for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(prompts):
        with Engine(g, None, EngineConfig(kv="best-4", chunk_tokens=64, step_tokens=128)) as e:
            reqs = [e.submit(p, params) for p in prompts]
            while e.step():
                pass
            return [r.output_ids for r in reqs]
    assert run(ps) == [run([p])[0] for p in ps]


@pytest.mark.model
def test_builtin_model_loads_without_inflating():
    model, tok = lessmem.load("smollm2-135m")
    rep = model._lessmem_gguf
    held = rep["bytes_mapped"] + rep["bytes_copied"]
    assert held < 100e6 and rep["inflated"] == []  # the file is 98 MB; floats would be 538 MB
    assert rep["types"]["model.embed_tokens"] == "q8_0" and rep["types"]["model.layers.0.mlp.up_proj"] == "q4_1"
    floats, _ = lessmem.load("smollm2-135m", weights="float")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        a8, b = model(ids).logits, floats(ids).logits  # 6 rows: the fused kernel, int8 activations
        assert a8[0, -1].argmax() == b[0, -1].argmax()
        set_int8_activations(model, False)
        a = model(ids).logits
        assert torch.allclose(a, b, atol=2e-4, rtol=0), (a - b).abs().max()
        set_int8_activations(model, True)
        out = model.generate(ids, max_new_tokens=8, do_sample=False, temperature=None, top_p=None, top_k=None)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_gguf_path_keeps_its_config_and_tokenizer(tmp_path, monkeypatch):
    """``lessmem.load(path.gguf)`` parses the file's metadata through transformers once, then
    reads the kept config and tokenizer (the parse set the load's peak memory); a file
    rewritten since is parsed again; the model and tokenizer are the same either way."""
    import os

    import transformers
    from _gguf_files import tiny_gguf

    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    tiny_gguf(path, tiny_random("llama"))
    parses = []
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def counting(cls, *a, **k):
        parses.append("gguf_file" in k)
        return real(cls, *a, **k)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(counting))
    ids = torch.tensor([[5, 6, 7, 8]])
    outs = []
    for _ in range(2):
        model, tok = lessmem.load(str(path))
        with torch.no_grad():
            outs.append((model(ids).logits, tok("hello world").input_ids))
    assert parses == [True, False]
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    assert len(list((tmp_path / "cache" / "models").glob("gguf-meta-*"))) == 1
    # ids in, ids out: no tokenizer is built once the metadata is kept, the model is the same
    model, tok = lessmem.load(str(path), tokenizer=False)
    assert tok is None and parses == [True, False] and not hasattr(model, "_lessmem_tokenizer")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, outs[0][0])
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    lessmem.load(str(path))
    assert parses == [True, False, True]
    # a file parsed for the first time: the tokenizer is built for the kept metadata, then dropped
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert lessmem.load(str(path), tokenizer=False)[1] is None
    assert parses == [True, False, True, True]
    lessmem.load(str(path))
    assert parses == [True, False, True, True, False]
    # the tokenizer alone, later: from the kept metadata, not a parse of the file
    later = lessmem.load_tokenizer(str(path))
    assert parses == [True, False, True, True, False, False]
    assert later("hello world").input_ids == outs[0][1]


def test_embedding_traces_whole_graph_and_still_checks_eagerly(tmp_path):
    # torch.compile(fullgraph=True) of a GGUF model's forward (transformers' StaticCache path)
    # stopped at the id range check (data-dependent); traced, the check is skipped, eager keeps it
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    g = load_gguf_blocks(write_model_gguf(m, tmp_path / "m.gguf", "q8_0"), config=m.config)
    emb = g.model.embed_tokens
    ids = torch.tensor([[1, 5, 271]])
    traced = torch.compile(emb, fullgraph=True, backend="eager")
    assert torch.equal(traced(ids), emb(ids))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 272\)"):
        emb(torch.tensor([[272]]))
