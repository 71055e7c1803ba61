"""The evaluator end to end with the built-in model on one small window."""

import math

import pytest

from lessmem.eval import evaluate, load_text
from lessmem.eval.caches import lessmem_presets


@pytest.mark.model
def test_builtin_model_small_window():
    from lessmem.models import load

    model, tok = load("smollm2-135m")
    configs = ["int8"] if "int8" in lessmem_presets() else ["hf-fp8"]
    name, text = load_text("pydoc")
    rows = evaluate(model, tok, configs, text, windows=1, window_len=192, chunk=16,
                    model_name="smollm2-135m", text_name=name)
    base, q = rows
    assert base["config"] == "dynamic" and math.isfinite(base["ppl"]) and 1 < base["ppl"] < 200
    assert base["tokens_scored"] == 192 - 48
    # an 8-bit cache barely moves this model: well under 1% and near-total top-1 agreement
    assert abs(q["delta_ppl_pct"]) < 1.0 and q["top1"] > 0.95 and 0 <= q["kld"] < 0.01
    assert q["kv_bytes"] < base["kv_bytes"]
