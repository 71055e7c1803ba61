"""``lessmem presets`` lists every KV preset with its effective bits."""

from __future__ import annotations

import json

from lessmem.cli import main
from lessmem.kvcache import PRESETS


def test_presets_json(capsys):
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    kv = {r["name"]: r for r in rows if r["kind"] == "kv"}
    assert set(kv) == set(PRESETS)
    assert kv["kivi-4"]["k_bits"] == 4 + 24 / 32 and kv["fp16"]["k_bits"] == 16
    assert kv["best-4"]["rotation"].startswith("K")


def test_presets_table_and_bad_head_dim(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "kivi-2" in out and "best-4" in out
    assert main(["presets", "--head-dim", "12"]) == 2
    assert "allowed: a positive multiple of 8" in capsys.readouterr().err
