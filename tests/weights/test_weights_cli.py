"""``lessmem quantize`` end to end on a tiny model directory."""

import json

import torch

import lessmem
from lessmem.cli import main
from lessmem.models import tiny_random, tiny_tokenizer


def test_cli_quantize_rtn_and_gptq(tmp_path, capsys):
    src = tmp_path / "tiny"
    m = tiny_random("llama")
    m.save_pretrained(str(src))
    tiny_tokenizer().save_pretrained(str(src))
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        rc = main(["quantize", "--model", str(src), "--method", method, "--bits", "4",
                   "--group-size", "32", "--calibration", str(calib), "--n-samples", "4",
                   "--seq-len", "64", "--out", str(out), "--json"])
        assert rc == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["method"] == method and rep["quantized_linears"] == 14
        if method == "gptq":
            assert rep["calibration"] == f"file {calib}"
        m2, tok = lessmem.load(str(out))
        assert m2.model.layers[1].mlp.up_proj.bits == 4
        x = torch.tensor([tok("fox")["input_ids"]])
        assert torch.isfinite(m2(x).logits).all()


def test_cli_errors(tmp_path, capsys):
    assert main(["quantize", "--method", "gptq", "--bits", "7", "--out", str(tmp_path)]) == 2
    assert "GPTQConfig bits=7 is not supported" in capsys.readouterr().err
    assert main(["quantize", "--method", "quip", "--out", str(tmp_path)]) == 2
    assert "--method quip: allowed: rtn, hqq, gptq, awq, smoothquant" in capsys.readouterr().err
    assert main(["quantize", "--format", "onnx", "--out", str(tmp_path)]) == 2
    assert "--format onnx: allowed: lessmem, gguf" in capsys.readouterr().err


def test_cli_default_group_falls_back_where_128_does_not_divide(tmp_path, capsys):
    """The built-in model's layers are 576 wide: without --group-size, 128 falls back to the
    largest group that divides (as the benchmarks do) and says so; an explicit 128 fails
    before the model loads, and nothing is written."""
    src = tmp_path / "tiny96"
    tiny_random("llama", hidden_size=96, num_heads=2, num_kv_heads=1, intermediate_size=192).save_pretrained(src)
    tiny_tokenizer().save_pretrained(str(src))
    capsys.readouterr()  # transformers' "Writing model shards" bar
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(src), "--group-size", "128", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--group-size 128: does not divide the model's layer widths 96, 192; allowed here: 32" in err
    assert err.count("\n") == 1 and not out.exists()
    assert main(["quantize", "--model", str(src), "--out", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert "--group-size not given: 128, and 64 or 32 where" in cap.err
    assert rep["group_sizes_used"] == {"32": 12, "64": 2} and rep["quantized_linears"] == 14
    assert (out / "lessmem_quant.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.")]  # the temp dir is gone
