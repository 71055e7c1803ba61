"""The evaluator end to end with the built-in model on one small window."""

import math

import pytest

from lessmem.eval import evaluate, load_text


@pytest.mark.model
def test_builtin_model_small_window():
    from lessmem.models import load

    model, tok = load("smollm2-135m")
    configs = ["int8"]
    name, text = load_text("pydoc")
    rows = evaluate(model, tok, configs, text, windows=1, window_len=192, chunk=16,
                    model_name="smollm2-135m", text_name=name)
    base, q = rows
    assert base["config"] == "dynamic" and math.isfinite(base["ppl"]) and 1 < base["ppl"] < 200
    assert base["tokens_scored"] == 192 - 48
    # an 8-bit cache barely moves this model: well under 1% and near-total top-1 agreement
    assert abs(q["delta_ppl_pct"]) < 1.0 and q["top1"] > 0.95 and 0 <= q["kld"] < 0.01
    assert q["kv_bytes"] < base["kv_bytes"]


def _run(code_or_args, env_extra=None, module=False, **kw):
    import os
    import subprocess
    import sys

    import lessmem

    env = {k: v for k, v in os.environ.items()
           if k not in (*lessmem.OMP_WAIT_VARS, "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "lessmem", *code_or_args] if module else [sys.executable, "-c", code_or_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, **kw)


def test_openmp_threads_spin_briefly_unless_told_otherwise():
    # set before torch starts the OpenMP runtime; an explicit setting is kept
    code = ("import lessmem, os, torch; print(*(os.environ.get(n, '-') for n in "
            "('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')))")
    assert _run(code).stdout.split() == ["-", "30000", "1"]
    assert _run(code, {"OMP_WAIT_POLICY": "ACTIVE"}).stdout.split() == ["ACTIVE", "-", "-"]
    assert _run(code, {"GOMP_SPINCOUNT": "0"}).stdout.split() == ["-", "0", "-"]


def test_eval_reports_each_stage_on_a_piped_stderr_and_keeps_transformers_quiet(tmp_path):
    from lessmem.models import tiny_random, tiny_tokenizer

    tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1).save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("".join(f"Paragraph {i}: numbers {i * i} and {i + 3}.\n" for i in range(300)))
    p = _run(["eval", "--model", str(tmp_path / "m"), "--text", str(text), "--window-len", "64",
              "--chunk", "8", "--kv", "int4"], {"OMP_NUM_THREADS": "1"}, module=True)
    assert p.returncode == 0, p.stderr
    err = p.stderr.splitlines()
    # one line per stage, each with the seconds since the start, none of them a tqdm bar
    assert [line.split("s ", 1)[1] for line in err if line.startswith("[eval]")] == [
        f"loading {tmp_path / 'm'} ...",
        "int4 vs the DynamicCache baseline, 1 x 64 tokens of " + str(text),
        "warm-up dynamic (1/2)", "warm-up int4 (2/2)",
        "window 1/1: 64 tokens through 2 caches",
        "perplexity: 25% (2/7 steps)", "perplexity: 50% (4/7 steps)",
        "perplexity: 75% (6/7 steps)", "perplexity: 100% (7/7 steps)", "done"]
    assert all(line.startswith("[eval]") for line in err), err
    # the table: which way is better, and what each column means
    out = p.stdout
    assert "KLD ↓" in out and "top-1 ↑" in out and "↓ lower is better, ↑ higher is better" in out
    assert "first use s  one-time cost" in out


def test_progress_on_a_terminal_draws_a_bar_and_keeps_the_stage_lines():
    import io

    from lessmem.eval.report import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    p = Progress(stream=out)
    with p.steps("perplexity"):
        for i in range(1, 5):
            p(i, 4)
            p.say(f"stage {i}")
    text = out.getvalue()
    assert "perplexity" in text and "━" in text  # the bar
    assert all(f"s stage {i}\n" in text for i in range(1, 5))
    assert "25% (1/4 steps)" not in text  # no quarter lines where the bar shows progress
    quiet = io.StringIO()
    q = Progress(enabled=False, stream=quiet)
    q.say("x")
    with q.steps("y"):
        q(1, 1)
    assert quiet.getvalue() == ""
