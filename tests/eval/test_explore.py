"""The quantization error explorer: table, outlier experiment, traffic, formats, CLI, plot."""

import json
import math
import resource
import subprocess
import sys

import pytest
import torch

from lessmem import cli
from lessmem.eval import explore as ex


@pytest.fixture(scope="module")
def outlier_w():
    torch.set_num_threads(1)
    return ex.synthetic_weights(128, 1024, seed=11, outliers=2)


def test_synthetic_is_seeded_and_outliers_in_first_128():
    a, ca = ex.synthetic_weights(8, 256, seed=3, outliers=2)
    b, cb = ex.synthetic_weights(8, 256, seed=3, outliers=2)
    assert torch.equal(a, b) and ca == cb and len(ca) == 2 and all(c < 128 for c in ca)
    assert a[:, ca].abs().mean() > 50 * a[:, [c for c in range(256) if c not in ca]].abs().mean()


def test_table_effective_bits_and_compression():
    w, _ = ex.synthetic_weights(16, 256, seed=11)
    rows = {(r["bits"], r["group"], r["scheme"]): r for r in ex.error_table(w)}
    assert len(rows) == 4 * 7 * 2
    r = rows[(4, "g32", "sym")]  # the simulator's panel: 4.50 bits/weight, 3.56x
    assert r["bits_per_weight"] == 4.5 and round(r["compression"], 2) == 3.56
    assert rows[(4, "g32", "asym")]["bits_per_weight"] == 4 + 16 / 32 + 4 / 32  # packed 4-bit zero point
    assert rows[(4, "g8", "sym")]["bits_per_weight"] == 6.0  # group 8: +2 bits, a 50% tax
    assert rows[(8, "per-channel", "sym")]["bits_per_weight"] == 8 + 16 / 256
    assert rows[(4, "per-tensor", "sym")]["bits_per_weight"] == pytest.approx(4 + 16 / 4096)
    for g in ("g8", "g32", "g128", "per-channel", "per-tensor"):
        snrs = [rows[(b, g, "sym")]["snr_db"] for b in (2, 3, 4, 8)]
        assert snrs == sorted(snrs), g  # SNR rises with bits
    # round-to-nearest: error at most half a step; a step is at most 2·max|w|/(2^b - 2)
    assert rows[(8, "per-tensor", "sym")]["max_abs_err"] <= float(w.abs().max()) / 127 / 2 * 1.001 + 1e-3


def test_outliers_collapse_per_tensor_and_group_32_recovers(outlier_w):
    w, cols = outlier_w
    o = ex.outlier_experiment(w, cols, bits=4, group=32)
    assert o["recovered_db"] >= 10  # the lecture: ~13 dB
    assert o["per_tensor"]["snr_db_ordinary"] < 1  # ordinary weights collapse onto the zero code
    assert o["g32"]["snr_db_ordinary"] > 10
    # the damage stays in the outlier's group
    g = o["g32"]
    assert g["mean_abs_err_ordinary_in_outlier_groups"] > 5 * g["mean_abs_err_elsewhere"]
    groups = g["groups_row0"]
    bad = [q for q in groups if q["outliers"]]
    good = [q for q in groups if not q["outliers"]]
    assert bad and good
    assert min(q["ordinary_max_abs_err"] for q in bad) > 5 * max(q["max_abs_err"] for q in good)


def test_no_outliers_smaller_groups_never_worse():
    w, _ = ex.synthetic_weights(64, 512, seed=1)
    snr = {r["group"]: r["snr_db"] for r in ex.error_table(w, bits=[4], schemes=["sym"])}
    order = ["g8", "g16", "g32", "g64", "g128", "per-channel", "per-tensor"]
    assert [snr[g] for g in order] == sorted(snr.values(), reverse=True)


def test_traffic_unfused_worse_than_fp16_fused_better(outlier_w):
    w, _ = outlier_w
    rows = ex.traffic_table(w, [("int4", "32"), ("int8", "channel")], bandwidth=1e12)
    fp16 = rows[0]
    fused = [r for r in rows if r["path"] == "fused"]
    unfused = [r for r in rows if r["path"] == "unfused"]
    assert fp16["bytes_per_weight"] == 2
    assert fused[0]["bytes_per_weight"] == 0.5625  # 4 bits + an fp16 scale per 32
    assert all(r["total"] < fp16["total"] for r in fused)
    assert all(r["total"] > fp16["total"] for r in unfused)
    assert unfused[0]["bytes_per_weight"] == 0.5625 + 4  # codes + fp16 written + read back
    assert fused[0]["seconds_at_bandwidth"] == fused[0]["total"] / 1e12


def test_format_rows_for_whatever_formats_exist(outlier_w, monkeypatch):
    w, _ = outlier_w
    names = ex.available_formats()
    rows = ex.formats_table(w, skipped=[])
    assert [r["format"] for r in rows] == names
    for r in rows:
        assert r["bits_per_weight"] > 1 and math.isfinite(r["snr_db"])
    if "q4_0" in names:
        assert next(r for r in rows if r["format"] == "q4_0")["bits_per_weight"] == 4.5
    monkeypatch.setattr(ex, "QUANTIZERS", {k: v for k, v in ex.QUANTIZERS.items() if "int" in k})
    assert ex.available_formats() == [] and ex.formats_table(w) == []


def test_granularity_labels_and_errors():
    assert ex._label(ex.granularity("g32", 64)) == "g32"
    assert ex._label(ex.granularity("channel", 64)) == "per-channel"
    with pytest.raises(ValueError, match=r"group 'abc'; allowed: a positive group size"):
        ex.granularity("abc", 64)
    with pytest.raises(ValueError, match=r"group 48 does not divide the 64 columns"):
        ex.granularity("48", 64)
    w, _ = ex.synthetic_weights(4, 64)
    with pytest.raises(ValueError, match=r"bits=9; allowed: 2, 3, 4"):
        ex.error_table(w, bits=[9])
    with pytest.raises(ValueError, match=r"scheme 'both'; allowed: sym, asym"):
        ex.error_table(w, schemes=["both"])
    with pytest.raises(ValueError, match=r"outliers=200; allowed: 0 to 64"):
        ex.synthetic_weights(4, 64, outliers=200)


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "out.png"
    assert cli.main(["explore", "--bits", "2,3,4,8", "--outliers", "--plot", str(png), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["source"]["outlier_cols"] and r["outliers"]["recovered_db"] >= 10
    assert len(r["table"]) == 4 * 7 * 2 and r["plot"] == str(png)
    import matplotlib.image as mpimg

    img = mpimg.imread(str(png))
    assert img.shape[0] > 500 and img.shape[1] > 500 and img[..., :3].std() > 0.05  # not blank


def test_cli_table_output(capsys):
    assert cli.main(["explore", "--bits", "4", "--outliers", "--formats", "none", "--rows", "32"]) == 0
    out = capsys.readouterr().out
    for s in ("Bits x group size", "recovered", "Per-group error", "unfused", "4.5 "):
        assert s in out, s


@pytest.mark.slow
def test_lecture_command_cpu_time_under_10_s(tmp_path):
    # wall time on this shared 2-core box depends on the other jobs; CPU time does not
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "lessmem", "explore", "--bits", "2,3,4,8", "--outliers",
                        "--plot", str(tmp_path / "o.png")], capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 10, cpu


@pytest.mark.parametrize("args,match", [
    (["--bits", "9"], "--bits 9: allowed: comma-separated integers in [2, 8]"),
    (["--bits", "x"], "--bits x: allowed: comma-separated integers"),
    (["--groups", "abc"], "--groups abc: allowed: comma-separated group sizes"),
    (["--tensor", "blk.0.attn_q.weight"], "--tensor blk.0.attn_q.weight: needs --model"),
    (["--list-tensors"], "--list-tensors: needs --model"),
    (["--model", "gpt-5", "--tensor", "x"], "--model gpt-5: allowed: a built-in alias (smollm2-135m, gemma3-270m)"),
    (["--model", "smollm2-135m"], "--model smollm2-135m: needs --tensor NAME"),
    (["--formats", "q9_9"], "--formats q9_9: unknown q9_9"),
    (["--group", "48"], "--group 48: does not divide the 1024 columns"),
    (["--schemes", "sym,both"], "--schemes sym,both: allowed: comma-separated schemes out of sym, asym"),
])
def test_cli_errors_one_line_exit_2(args, match, capsys):
    assert cli.main(["explore", "--rows", "8", "--formats", "none", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_what_it_buys_panel():
    # the simulator: fp16 ~4.8 ms/token ~209 tok/s; 4-bit g32: 4.5 bits, 11.1% scales, ~4.2 GiB
    # of weights, 16.0 GiB of unquantized KV (128K tokens), fits in 24 GiB
    fp16, q = ex.what_it_buys(4, 32)
    assert round(fp16["seconds_per_token"] * 1e3, 1) == 4.8 and round(fp16["tok_s"]) == 209
    assert q["bits_per_weight"] == 4.5 and round(100 * q["scale_share"], 1) == 11.1
    assert round(q["weight_bytes"] / 2**30, 1) == 4.2 and q["kv_fp16_bytes"] == 16 * 2**30
    assert q["fits"] and not fp16["fits"]
    assert fp16["seconds_per_token"] / q["seconds_per_token"] == pytest.approx(16 / 4.5, rel=2e-3)


def test_plain_text_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert cli.main(["explore", "--bits", "4", "--rows", "8", "--formats", "none"]) == 0
    out = capsys.readouterr().out
    assert "Traffic of one decode matmul" in out and "unfused" in out and "┃" not in out
