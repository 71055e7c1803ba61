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
