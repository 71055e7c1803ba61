"""Per-layer KV bits from measured sensitivity (lessmem.eval.allocate)."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from lessmem.eval.allocate import Sensitivity, allocate, measure_sensitivity, probe_configs
from lessmem.formats import PerGroup
from lessmem.kvcache import PRESETS, KVCache, KVConfig, KVTensorConfig, enable
from lessmem.kvcache.presets import load_config, resolve


def run_chunks(model, ids, cache, sizes):
    """Logits of every position, ``ids`` fed through ``cache`` in chunks of ``sizes``."""
    from lessmem.kvcache.cache import cache_kwargs

    out, s = [], 0
    with torch.no_grad():
        for n in sizes:
            out.append(model(ids[:, s:s + n], **cache_kwargs(model, cache)).logits)
            s += n
    return torch.cat(out, dim=1)


TEMPLATE = PRESETS["best-3"]  # keys uint ch128 (0.1875 bits of metadata), values lm per token (0.25)


def _mean_bits(cfg, n):
    return sum(cfg.effective_bits(64, num_layers=n)) / 2


def _cost(s, cfg):
    return sum(s.keys[i][s.bits.index(cfg.for_layer(i)[0].bits)]
               + s.values[i][s.bits.index(cfg.for_layer(i)[1].bits)] for i in range(s.num_layers))


@pytest.mark.parametrize("seed", range(5))
def test_allocate_is_the_least_cost_within_the_budget(seed):
    """Against brute force over every per-layer choice: the DP finds the optimum."""
    rng = random.Random(seed)
    n, bits = 3, (2, 3, 4)
    rows = [sorted((rng.random() * 10 ** rng.uniform(-3, 0) for _ in bits), reverse=True)
            for _ in range(2 * n)]
    s = Sensitivity(TEMPLATE, bits, rows[:n], rows[n:])
    for mean in (2.5, 3.0, 3.3, 3.72, 4.3):
        cfg = allocate(s, mean, 64)
        assert _mean_bits(cfg, n) <= mean + 1e-9
        best = min(sum(r[bits.index(b)] for r, b in zip(rows, pick, strict=True))
                   for pick in itertools.product(bits, repeat=2 * n)
                   if sum(pick) / (2 * n) + (0.1875 + 0.25) / 2 <= mean + 1e-9)
        assert _cost(s, cfg) == pytest.approx(best)


def test_allocate_spends_bits_where_they_cost_most():
    s = Sensitivity(TEMPLATE, (2, 4), keys=[[5.0, 0.0], [0.1, 0.0]], values=[[0.2, 0.0], [0.01, 0.0]])
    cfg = allocate(s, 2.5 + (0.1875 + 0.25) / 2, 64)  # one side of the four at 4 bits
    assert [(cfg.for_layer(i)[0].bits, cfg.for_layer(i)[1].bits) for i in range(2)] == [(4, 2), (2, 2)]
    assert cfg.keys.granularity == TEMPLATE.keys.granularity and cfg.values.format == "lm"
    assert cfg.window == TEMPLATE.window and cfg.rotate_keys and cfg.rotate_values
    with pytest.raises(ValueError, match=r"mean_bits=2.0; allowed: at least 2.219"):
        allocate(s, 2.0, 64)
    with pytest.raises(TypeError, match="mean_bits='3'; allowed: a number"):
        allocate(s, "3", 64)


def test_sensitivity_round_trip_and_bad_tables():
    s = Sensitivity(TEMPLATE, (2, 3), keys=[[1.0, 0.5]], values=[[0.3, 0.1]], protocol={"windows": 1})
    assert Sensitivity.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(ValueError, match="keys: one row of 2 costs per layer"):
        Sensitivity(TEMPLATE, (2, 3), keys=[[1.0]], values=[[0.3, 0.1]])
    with pytest.raises(ValueError, match="bits=8 for format 'lm'; allowed: 2, 3, 4"):
        Sensitivity(TEMPLATE, (2, 8), keys=[[1.0, 0.5]], values=[[0.3, 0.1]])
    with pytest.raises(ValueError, match="keys has 2 layers and values 1"):
        Sensitivity(TEMPLATE, (2,), keys=[[1.0], [2.0]], values=[[0.3]])
    with pytest.raises(ValueError, match="finite"):
        Sensitivity(TEMPLATE, (2,), keys=[[float("nan")]], values=[[0.3]])


def test_probe_configs_quantize_one_side_of_one_layer():
    probes = probe_configs(TEMPLATE, 2, (2, 4))
    assert sorted(probes) == ["L0-k2", "L0-k4", "L0-v2", "L0-v4", "L1-k2", "L1-k4", "L1-v2", "L1-v4"]
    k, v = probes["L1-k2"].for_layer(1)
    assert (k.format, k.bits, k.granularity, v.format, v.bits) == ("uint", 2, TEMPLATE.keys.granularity, "int", 8)
    assert probes["L1-k2"].for_layer(0) == (KVTensorConfig("none", 16), KVTensorConfig("none", 16))


def test_to_plan_describes_bit_overrides_by_their_mean():
    cfg = TEMPLATE.replace(layer_overrides=((0, KVTensorConfig("uint", 2, TEMPLATE.keys.granularity),
                                             KVTensorConfig("lm", 4)),))
    p = cfg.to_plan("mix", num_layers=4)
    assert (p.k_bits, p.v_bits) == ((2 + 3 * 4) / 4, (4 + 3 * 3) / 4)
    assert p.k_group_tokens == 128 and p.v_zero_point_bytes == 0
    with pytest.raises(ValueError, match="needs num_layers"):
        cfg.to_plan()
    with pytest.raises(ValueError, match="name layer 0; allowed: layers 0 to -1|num_layers"):
        cfg.to_plan(num_layers=0)


def test_measure_then_allocate_on_a_tiny_model(tmp_path):
    """The whole path on a real (tiny random) Llama: measure, allocate, save, load by file
    name, and run the mixed cache under the fused attention against its dequantized twin."""
    from lessmem.models import tiny_random, tiny_tokenizer

    model, tok = tiny_random("llama"), tiny_tokenizer()
    template = TEMPLATE.replace(window=8, sinks=2, block_size=32,
                                keys=KVTensorConfig("uint", 4, PerGroup(32, axis=-2)))
    text = "the quick brown fox jumps over the lazy dog. " * 12
    s = measure_sensitivity(model, tok, text, template, (2, 4), windows=1, window_len=160, chunk=16)
    assert s.num_layers == 2 and s.protocol["window_len"] == 160
    assert all(c >= 0 for row in s.keys + s.values for c in row)
    assert sum(r[0] for r in s.keys + s.values) > sum(r[1] for r in s.keys + s.values)  # 2 bits cost more
    cfg = allocate(s, 3.0 + (24 / 32 + 16 / 16) / 2, 16)  # head_dim 16: half the sides at 4 bits
    assert {cfg.for_layer(i)[j].bits for i in range(2) for j in range(2)} == {2, 4}
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert load_config(str(path)) == cfg == resolve(str(path))
    ids = torch.tensor([tok(text)["input_ids"][:120]])
    out = []
    for fused in (True, False):  # 64 tokens prefilled, then chunks of 8 over the quantized history
        cache = KVCache(model.config, str(path))
        with enable(model) if fused else contextlib.nullcontext():
            out.append(run_chunks(model, ids, cache, [64] + [8] * 7))
        assert cache.memory()["codes"] > 0
        assert {layer.kspec.bits for layer in cache.layers} == {cfg.for_layer(i)[0].bits for i in range(2)}
    torch.testing.assert_close(out[0], out[1], rtol=2e-4, atol=2e-4)


def test_kv_config_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"KV config file '.*nope.json' does not exist"):
        resolve(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        resolve(str(bad))
    bad.write_text(json.dumps({"keys": {}}))
    with pytest.raises(ValueError, match=r"KV config file .*bad.json.*missing keys"):
        resolve(str(bad))
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(KVConfig().to_dict()))
    from lessmem.eval.caches import resolve_config

    spec = resolve_config(str(ok))
    assert spec.name == "ok" and spec.kind == "lessmem"


def test_cli_takes_a_kv_config_file(tmp_path, capsys):
    from lessmem.cli import main

    assert main(["eval", "--kv", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "benchmarks" / "results" / "kv_layer_sensitivity.json"


@pytest.mark.model
def test_cli_allocates_the_committed_config_from_the_committed_table(tmp_path, capsys):
    """`lessmem kv-allocate` on the built-in model reads the measured table and writes the
    allocation bench_kv_quality evaluated (benchmarks/results/kv_configs/mixed-3.5.json)."""
    from lessmem.cli import main

    out = tmp_path / "kv.json"
    assert main(["kv-allocate", "--bits", "3.5", "--sensitivity", str(TABLE), "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "with window and sinks at 8192 tokens" in printed and f"wrote {out}" in printed
    committed = KVConfig.from_dict(json.loads((TABLE.parent / "kv_configs" / "mixed-3.5.json").read_text()))
    assert load_config(str(out)) == committed
    # a budget the model's shape cannot meet is refused after the load, before any measuring
    assert main(["kv-allocate", "--bits", "2.2", "--out", str(tmp_path / "low.json"), "--no-progress"]) == 2
    assert "--bits" in capsys.readouterr().err and not (tmp_path / "low.json").exists()


def test_cli_measures_writes_the_table_then_reuses_it(tmp_path, capsys):
    """The measuring path of `lessmem kv-allocate` on a tiny random Llama saved to disk."""
    from lessmem.cli import main
    from lessmem.models import tiny_random, tiny_tokenizer

    tiny_random("llama").save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(str(tmp_path / "model"))
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    table, out = tmp_path / "sens.json", tmp_path / "kv.json"
    argv = ["kv-allocate", "--model", str(tmp_path / "model"), "--layout", "best-2", "--choices", "2,3",
            "--text", str(tmp_path / "text.txt"), "--windows", "1", "--window-len", "256", "--chunk", "32",
            "--context", "4096", "--sensitivity", str(table), "--out", str(out), "--no-progress"]
    assert main([*argv, "--bits", "2.5"]) == 2  # head_dim 16: per-token scales alone cost 1.5 bits
    assert "allowed: at least 3.346" in capsys.readouterr().err and not table.exists()
    assert main([*argv, "--bits", "3.9"]) == 0
    s = Sensitivity.from_dict(json.loads(table.read_text()))
    assert s.num_layers == 2 and s.bits == (2, 3) and s.template == PRESETS["best-2"]
    assert s.protocol["window_len"] == 256 and sum(map(sum, s.keys)) > 0
    cfg = load_config(str(out))
    assert {cfg.for_layer(i)[j].bits for i in range(2) for j in range(2)} == {2, 3}
    capsys.readouterr()
    before = table.stat().st_mtime_ns
    assert main([*argv, "--bits", "3.35"]) == 0  # the table is read, not measured again
    assert table.stat().st_mtime_ns == before
    assert load_config(str(out)).for_layer(0)[0].bits == 2
    # a table of another layout is refused before anything loads
    assert main([*argv[:4], "best-4", *argv[5:], "--bits", "3"]) == 2
    assert "--sensitivity" in capsys.readouterr().err
