"""`lessmem plan`: the lecture command, --json in base units, one-line errors, no torch."""

import json
import subprocess
import sys

import pytest

from lessmem import cli

LECTURE = ["plan", "--model", "llama-3-8b", "--context", "16384", "--batch", "16",
           "--kv", "fp16,fp8,int4", "--kv-budget", "4GiB"]


def _run(args):
    return subprocess.run([sys.executable, "-m", "lessmem", *args], capture_output=True, text=True, timeout=120)


def test_plan_never_imports_torch(run_torch_free):
    r = run_torch_free("import lessmem.plan, lessmem.plan.cli, lessmem.plan.report, lessmem.plan._reference;"
                       "from lessmem.plan import plan; plan('llama-3-8b', context=16384, batch=16, kv_budget='4GiB');"
                       "from lessmem import cli; cli.main(['plan', '--json', '--kv', 'kivi-2,int4'])")
    assert r.returncode == 0, r.stderr


def test_lecture_command_prints_the_figures(capsys):
    assert cli.main(LECTURE) == 0
    out = capsys.readouterr().out
    for figure in ("65,536·b", "128.00 KiB", "64.00 KiB", "32.00 KiB", "2.00 GiB", "1.00 GiB",
                   "512.00 MiB", "32.00 GiB", "16.00 GiB", "8.00 GiB", "2.86 ms", "171.8 ms", "859.0 ms",
                   "60x", "300x", "65,536 (4,096/req, 25%)", "12,288/req (768.00 MiB each)",
                   "1,600 KiB/s = 1.5625 MiB/s ≈ 0.0016 GB/s", "4.29 GB"):
        assert figure in out, figure


def test_json_in_base_units(capsys):
    assert cli.main([*LECTURE, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert [r["per_token"] for r in p["kv"]] == [131072, 65536, 32768]
    assert [r["total"] for r in p["kv"]] == [32 * 2**30, 16 * 2**30, 8 * 2**30]
    assert [round(t["seconds"], 6) for t in p["transfer"]["tiers"]] == [0.002863, 0.171799, 0.858993]
    fp8 = next(r for r in p["hybrid"]["rows"] if r["precision"] == "fp8")
    assert fp8["resident_tokens_total"] == 65536 and fp8["offloaded_bytes_per_request"] == 768 * 2**20
    assert fp8["sliding"]["demand_bytes_per_s"] == 1_638_400
    assert p["hybrid"]["chosen"] == "fp8" and p["inputs"]["kv_budget"] == 4 * 2**30


def test_overrides_and_weights_flags(capsys):
    assert cli.main(["plan", "--model", "llama-3-8b", "--params", "8e9", "--hardware", "h100",
                     "--weights", "fp16,int4-g32,q4_k_m", "--context", "1", "--kv", "fp16",
                     "--pcie-gen", "3", "--nvme-bw", "7GB/s", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["hardware"]["pcie_bw"] == 12.5e9 and p["hardware"]["nvme_bw"] == 7e9
    assert round(p["decode"][0]["seconds_per_token"] * 1e3, 2) == 4.78
    assert [w["format"] for w in p["weights"]] == ["fp16", "int4-g32", "Q4_K_M"]


def test_list_and_presets_and_cpu(capsys):
    assert cli.main(["plan", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "mi300x" in out and "kivi-2" in out
    assert cli.main(["plan", "--model", "smollm2-135m", "--hardware", "laptop-cpu", "--context", "8k",
                     "--batch", "4", "--kv", "fp16,kivi-4,lessmem:int8", "--kv-budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "kivi-4" in out and "nvme" in out


def test_nothing_fits_says_what_would(capsys):
    assert cli.main(["plan", "--context", "16384", "--batch", "16", "--kv", "fp16,int4",
                     "--kv-budget", "1GiB", "--json"]) == 0
    h = json.loads(capsys.readouterr().out)["hybrid"]
    assert any("int4 fits entirely with batch <= 2" in s for s in h["suggestions"])
    assert cli.main(["plan", "--context", "1024", "--batch", "16", "--kv", "fp16", "--kv-budget",
                     "1MiB", "--json"]) == 0
    h = json.loads(capsys.readouterr().out)["hybrid"]
    assert h["rows"][0]["resident_tokens_per_request"] == 0 and "less than one token" in h["suggestions"][-1]


@pytest.mark.parametrize("args,match", [
    (["--model", "gpt-5"], "unknown model 'gpt-5'; choose one of: llama-3-8b"),
    (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'; choose one of: generic-gpu"),
    (["--context", "-5"], "--context -5: allowed: a whole number in [1, "),
    (["--kv-budget", "100"], "kv_budget=100 bytes is below one token"),
    (["--kv", "fp7"], "unknown KV precision 'fp7'"),
    (["--weights", "int9"], "unknown weight format 'int9'"),
    (["--kv-budget", "lots"], "--kv-budget lots: allowed: a size"),
    (["--pcie-gen", "9"], "--pcie-gen 9: allowed: 1, 2, 3, 4, 5, 6"),
])
def test_bad_input_one_line_exit_2(args, match, capsys):
    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_config_json_subprocess(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 2,')
    r = _run(["plan", "--model", str(bad)])
    assert r.returncode == 2 and "malformed config.json" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_plain_text_without_rich(monkeypatch):
    from lessmem.plan import plan, report

    monkeypatch.setitem(sys.modules, "rich.console", None)
    out = report.render(plan("llama-3-8b", context=16384, batch=16, kv="fp16,fp8", kv_budget="4GiB"))
    assert "171.8 ms" in out and "4,096/req" in out and "┃" not in out
