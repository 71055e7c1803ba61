"""GPTQ inside GGUF blocks (weights.gguf_gptq) and the block grids it rests on (formats.gguf_codes)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from _gguf_files import spread_norms, tiny_gguf

import lessmem
from lessmem.cli import main
from lessmem.formats import gguf_codes
from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
from lessmem.models import tiny_random
from lessmem.weights.gguf_gptq import gptq_gguf
from lessmem.weights.gguf_linear import GGUFLinear

TYPES = sorted(gguf_codes.SPECS)
K_TYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm sun. " * 30


def _weights(rows=16, cols=512, seed=0):
    g = np.random.default_rng(seed)
    x = (g.standard_normal((rows, cols)) * np.exp(g.standard_normal((rows, 1)))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: step 0, codes kept
    return x


@pytest.mark.parametrize("qtype", TYPES)
def test_grid_codes_round_trip(qtype):
    x = _weights()
    imp = np.random.default_rng(1).random(512).astype(np.float32)
    for im in (None, imp):
        raw = quantize_gguf(x, qtype, imatrix=im)
        u = gguf_codes.codes(raw, qtype)
        g = gguf_codes.grid(raw, qtype)
        assert np.array_equal(gguf_codes.with_codes(raw, qtype, u), raw)
        assert np.array_equal(g.decode(u), dequantize_gguf(raw, qtype, x.shape).numpy())  # exactly
        if qtype in K_TYPES:  # the K-quants end on nearest codes against their stored scales
            assert np.array_equal(gguf_codes.nearest_codes(x, g, u), u)
        elif qtype.startswith("iq4"):  # IQ4 against the scale before fp16 rounding: nearly all
            assert (gguf_codes.nearest_codes(x, g, u) == u).mean() > 0.99
        v = u.copy()
        v[:, 5] = g.qmax - v[:, 5]  # other codes: only the code bytes change
        changed = gguf_codes.with_codes(raw, qtype, v)
        assert np.array_equal(gguf_codes.codes(changed, qtype), v)
        assert np.array_equal(gguf_codes.grid(changed, qtype).d, g.d)


def test_grid_bad_input():
    raw = quantize_gguf(_weights(2, 256), "q4_k")
    with pytest.raises(ValueError, match="GGUF type 'f16' is not supported"):
        gguf_codes.grid(raw, "f16")
    with pytest.raises(ValueError, match="codes must lie in 0..15"):
        gguf_codes.with_codes(raw, "q4_k", np.full((2, 256), 16))
    with pytest.raises(ValueError, match="codes have 10 elements; raw holds 512"):
        gguf_codes.with_codes(raw, "q4_k", np.zeros(10))
    with pytest.raises(ValueError, match=r"rows must be \[rows, k \* 144\] bytes"):
        gguf_codes.codes(raw[:, :100], "q4_k")


@pytest.mark.parametrize("qtype", K_TYPES)
def test_diagonal_hessian_is_the_imatrix_encoding(qtype):
    """No correlation between inputs: nothing to carry, the bytes of llama.cpp's weighted quantizer."""
    w = torch.from_numpy(_weights(8, 512, seed=2))
    d = torch.rand(512, generator=torch.Generator().manual_seed(3)) + 0.05
    assert np.array_equal(gptq_gguf(w, torch.diag(d), qtype), quantize_gguf(w, qtype, imatrix=d / 2))


@pytest.fixture(scope="module")
def correlated():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 512, generator=g) @ torch.randn(512, 512, generator=g) / 20
    w = torch.randn(24, 512, generator=g)
    return x, w, (2 * x.T.double() @ x.double() / x.shape[0]).float()


@pytest.mark.parametrize("qtype", TYPES)
def test_error_feedback_lowers_output_error(qtype, correlated):
    x, w, h = correlated
    raw = gptq_gguf(w, h, qtype)
    plain = quantize_gguf(w, qtype, imatrix=torch.diag(h) / 2)
    assert raw.shape == plain.shape and raw.dtype == np.uint8

    def err(r):
        return ((x @ (w - dequantize_gguf(r, qtype, tuple(w.shape))).T) ** 2).mean().item()

    assert err(raw) < 0.8 * err(plain), (err(raw), err(plain))
    if qtype in K_TYPES:  # the first super-block saw no feedback yet: llama.cpp's own scales
        g1, g2 = gguf_codes.grid(raw, qtype), gguf_codes.grid(plain, qtype)
        assert np.array_equal(g1.d[:, :256], g2.d[:, :256]) and np.array_equal(g1.m[:, :256], g2.m[:, :256])


def test_gptq_gguf_bad_input(correlated):
    _, w, h = correlated
    with pytest.raises(ValueError, match="GGUF type 'f16' is not supported"):
        gptq_gguf(w, h, "f16")
    with pytest.raises(ValueError, match="Q4_K encodes rows in blocks of 256; the weight has 288"):
        gptq_gguf(w[:, :288], h[:288, :288], "q4_k")
    with pytest.raises(ValueError, match=r"h must be the \[in, in\] = \[512, 512\] Hessian"):
        gptq_gguf(w, h[:8], "q4_k")
    with pytest.raises(ValueError, match="damp=0; allowed: a number in"):
        gptq_gguf(w, h, "q4_k", damp=0)
    with pytest.raises(ValueError, match="is not supported"):
        gptq_gguf(w, h, "q7_k")


def _model():
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    spread_norms(m)
    return m


def _ids(n=8, t=64, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_quantize_calibrated_in_memory_beats_imatrix():
    from lessmem.weights.imatrix import collect_imatrix

    calib, test = _ids(16, 128), _ids(2, 64, seed=1)
    base = _model()
    with torch.no_grad():
        ref = base(test).logits
    errs, types = {}, {}
    for kind in ("plain", "imatrix", "gptq", "awq", "awq+gptq"):
        m = _model()
        if kind in ("gptq", "awq", "awq+gptq"):
            cfg = lessmem.GGUFConfig("Q3_K_M", gptq="gptq" in kind, awq="awq" in kind, n_samples=16,
                                     seq_len=128, n_grid=8)
        elif kind == "imatrix":
            cfg = lessmem.GGUFConfig("Q3_K_M", imatrix=collect_imatrix(m, calib, n_samples=16, seq_len=128))
        else:
            cfg = lessmem.GGUFConfig("Q3_K_M")
        rep = lessmem.quantize_(m, cfg, calibration=calib, progress=False)
        assert rep["n_quantized"] == 15 and isinstance(m.model.layers[1].mlp.down_proj, GGUFLinear)
        types[kind] = rep["types"]
        with torch.no_grad():
            errs[kind] = ((m(test).logits - ref) ** 2).mean().item()
        if kind == "gptq":
            assert rep["calibration"]["tokens"] == 2048 and rep["config"]["gptq"] is True
            assert rep["layers"][0]["self_attn.q_proj"] == {"tokens": 2048, "type": rep["types"][
                "model.layers.0.self_attn.q_proj"]}
        if kind == "awq":  # the scaling groups searched and folded, then the linears encoded
            assert rep["config"]["awq"] is True and rep["config"]["n_grid"] == 8
            assert set(rep["layers"][0]) == {"input_layernorm", "post_attention_layernorm", "self_attn.v_proj",
                                             "mlp.up_proj", *(f"self_attn.{p}_proj" for p in "qkvo"),
                                             *(f"mlp.{p}_proj" for p in ("gate", "up", "down"))}
            e = rep["layers"][1]["post_attention_layernorm"]
            assert e["loss_best"] <= e["loss_alpha0"]
    assert all(types[k] == types["plain"] for k in types)  # the mix's rules, whatever the method
    # random inputs are nearly uncorrelated, which leaves GPTQ little to carry (0.78x here;
    # 0.5-0.6x on correlated inputs above); the spread norms give AWQ outlier channels to protect
    assert errs["gptq"] < 0.9 * errs["imatrix"] < 0.9 * errs["plain"], errs
    assert errs["awq"] < 0.9 * errs["imatrix"] and errs["awq+gptq"] < 0.9 * errs["gptq"], errs


def test_gguf_config_gptq_bad_input():
    from lessmem.weights.imatrix import IMatrix

    with pytest.raises(ValueError, match="pass those or imatrix=..., not both"):
        lessmem.GGUFConfig("Q4_K_M", gptq=True, imatrix=IMatrix({}))
    with pytest.raises(ValueError, match="gptq"):
        lessmem.GGUFConfig("Q4_K_M", gptq="yes")
    with pytest.raises(ValueError, match="n_samples"):
        lessmem.GGUFConfig("Q4_K_M", gptq=True, n_samples=0)
    with pytest.raises(ValueError, match="pass those or imatrix=..., not both"):
        lessmem.GGUFConfig("Q4_K_M", awq=True, imatrix=IMatrix({}))
    with pytest.raises(ValueError, match="n_grid"):
        lessmem.GGUFConfig("Q4_K_M", awq=True, n_grid=0)
    with pytest.raises(ValueError, match="awq"):
        lessmem.GGUFConfig("Q4_K_M", awq=1)


def _load_logits(path, ids):
    model, _ = lessmem.load(str(path))
    assert model._lessmem_gguf["inflated"] == []  # every block type held as it is (IQ4 too)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("method, mix", [("gptq", "Q3_K_M"), ("awq+gptq", "Q3_K_M"), ("awq+gptq", "IQ4_XS")])
def test_cli_calibrated_writes_a_llama_cpp_file(tmp_path, capsys, method, mix):
    src = tmp_path / "tiny.gguf"
    m = _model()
    tiny_gguf(src, m)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    base = ["quantize", "--model", str(src), "--format", "gguf", "--type", mix, "--json"]
    out_g, out_p = tmp_path / "gptq.gguf", tmp_path / "plain.gguf"
    rc = main([*base, "--method", method, "--calibration", str(calib), "--n-samples", "4",
               "--seq-len", "64", "--out", str(out_g)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads(cap.out)
    assert rep["method"] == method and rep["calibrated_linears"] == 14 and rep["calibration"] == f"file {calib}"
    assert rep.get("awq_scales", 0) == (6 if method == "awq+gptq" else 0)  # 3 groups x 2 layers (v->o does
    # not fold: each of the 2 KV heads' values feeds 2 query heads)
    assert main([*base, "--out", str(out_p)]) == 0
    capsys.readouterr()
    rg, rp = gguf.GGUFReader(str(out_g)), gguf.GGUFReader(str(out_p))
    tg = {t.name: t for t in rg.tensors}
    tp = {t.name: t for t in rp.tensors}
    assert {n: t.tensor_type for n, t in tg.items()} == {n: t.tensor_type for n, t in tp.items()}
    assert out_g.stat().st_size == out_p.stat().st_size  # same types, same bytes
    assert np.array_equal(np.array(tg["token_embd.weight"].data), np.array(tp["token_embd.weight"].data))
    assert not np.array_equal(np.array(tg["blk.0.ffn_up.weight"].data), np.array(tp["blk.0.ffn_up.weight"].data))
    # AWQ's scales folded into the norms reach the file; without AWQ the norms are the source's
    norm_changed = not np.array_equal(np.array(tg["blk.0.ffn_norm.weight"].data),
                                      np.array(tp["blk.0.ffn_norm.weight"].data))
    assert norm_changed == (method == "awq+gptq")
    # the file decodes as the model it came from: q/k rows back in llama.cpp's order, so
    # loading it gives logits nearer the float model's than the plain file's. Both files hold
    # the same plainly encoded embedding and output (whose error dominates on this tiny model):
    # the reference is the float model with those two as stored, so the blocks are compared
    assert np.array_equal(np.array(tg["output.weight"].data), np.array(tp["output.weight"].data))
    with torch.no_grad():
        for t, mod in ((tp["token_embd.weight"], m.model.embed_tokens), (tp["output.weight"], m.lm_head)):
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            mod.weight.copy_(torch.from_numpy(w).reshape(mod.weight.shape))
    ids = torch.tensor([[int(b) for b in TEXT.encode()[:96]]])
    with torch.no_grad():
        ref = m(ids).logits
    eg = ((_load_logits(out_g, ids) - ref) ** 2).mean().item()
    ep = ((_load_logits(out_p, ids) - ref) ** 2).mean().item()
    assert eg < ep, (eg, ep)


def test_cli_gguf_methods_checked(tmp_path, capsys):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src, _model())
    (tmp_path / "im.dat").write_bytes(b"x")
    g = ["quantize", "--model", str(src), "--format", "gguf", "--out", str(tmp_path / "q.gguf")]
    for argv, expect in [([*g, "--method", "hqq"], "allowed: rtn, imatrix, gptq, awq, awq+gptq"),
                         ([*g, "--method", "gptq", "--imatrix", str(tmp_path / "im.dat")],
                          "allowed with --imatrix/--imatrix-out: imatrix"),
                         ([*g, "--method", "gptq", "--seq-len", "100000"], "--seq-len")]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "q.gguf").exists()


def test_awq_fold_keeps_a_skipped_linear_exact():
    """A linear left float by ``skip`` reads the norm AWQ folds its scale into: its columns are
    scaled too, so its output is unchanged (norm weight x its columns, as before)."""
    m = _model()
    before = m.model.layers[0].input_layernorm.weight.detach().clone()[None, :] * \
        m.model.layers[0].self_attn.k_proj.weight.detach().clone()
    cfg = lessmem.GGUFConfig("Q8_0", awq=True, n_samples=4, seq_len=32, n_grid=3, skip=("*k_proj",))
    rep = lessmem.quantize_(m, cfg, calibration=_ids(4, 32), progress=False)
    layer = m.model.layers[0]
    assert type(layer.self_attn.k_proj) is torch.nn.Linear and "input_layernorm" in rep["layers"][0]
    assert not torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    after = layer.input_layernorm.weight.detach()[None, :] * layer.self_attn.k_proj.weight.detach()
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-7)
