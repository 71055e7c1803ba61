"""`lessmem eval` and `lessmem generate` end to end on a tiny saved model; bad input -> exit 2."""

import json

import pytest
import torch

from lessmem.cli import main
from lessmem.models import tiny_random, tiny_tokenizer

JSON_KEYS = {"config", "ppl", "delta_ppl_pct", "kld", "top1", "k_bits", "v_bits", "kv_bytes",
             "fp16_kv_bytes", "tok_per_s", "model", "text", "windows", "window_len", "chunk"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("".join(f"Paragraph {i}: numbers {i * i} and {i + 3}.\n" for i in range(200)))
    return f


def _eval(model_dir, text_file, *extra):
    return ["eval", "--model", str(model_dir), "--text", str(text_file), "--windows", "2",
            "--window-len", "64", "--chunk", "8", "--no-progress", *extra]


def test_eval_json_schema(model_dir, text_file, capsys, tmp_path):
    out = tmp_path / "r.json"
    rc = main(_eval(model_dir, text_file, "--kv", "hf-fp8", "--json", "--out", str(out),
                    "--plot", str(tmp_path / "p.png")))
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in rows] == ["dynamic", "hf-fp8"]
    for r in rows:
        assert JSON_KEYS <= set(r)
        assert (r["model"], r["text"], r["windows"], r["window_len"], r["chunk"]) == (
            str(model_dir), str(text_file), 2, 64, 8)
        assert r["ppl"] > 1 and 0 <= r["top1"] <= 1
    assert rows[0]["delta_ppl_pct"] == 0.0 and rows[0]["kld"] == 0.0
    assert json.loads(out.read_text()) == rows
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_eval_table_with_passkey(model_dir, text_file, capsys):
    rc = main(_eval(model_dir, text_file, "--kv", "hf-fp8", "--passkey", "512", "--passkey-depths", "0.5"))
    assert rc == 0
    out = capsys.readouterr().out
    assert "dynamic" in out and "hf-fp8" in out and "Δppl" in out and "/1" in out


@pytest.mark.parametrize("extra, match", [
    (["--kv", "int9"], "unknown KV config 'int9'"),
    (["--window-len", "4"], "--window-len 4: allowed: an integer in [8, "),
    (["--chunk", "0"], "--chunk 0: allowed: an integer in [1, "),
    (["--windows", "0"], "--windows 0: allowed"),
    (["--passkey", "1k"], "--passkey 1k: allowed: comma-separated integers"),
    (["--kv", ","], "names no config"),
    (["--window-len", "5000"], "--window-len 5000: 5,000 tokens per window, but the model's context is 4,096 tokens"),
    (["--passkey", "5000"], "--passkey 5000: a passkey prompt of 5,000 tokens, but the model's context is 4,096"),
    (["--plot", "p"], "--plot p: allowed: a file path ending in .png or .svg or .pdf"),
])
def test_eval_bad_input_exit_2(model_dir, text_file, capsys, extra, match):
    assert main(_eval(model_dir, text_file, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1 and err.startswith("lessmem eval: error:")


def test_eval_missing_text_file_exit_2(model_dir, capsys):
    assert main(["eval", "--model", str(model_dir), "--text", "/no/such.txt", "--no-progress"]) == 2
    assert "--text /no/such.txt: neither pydoc, wikitext2 nor an existing file" in capsys.readouterr().err


def test_eval_unknown_model_exit_2(text_file, capsys):
    assert main(["eval", "--model", "no-such-model", "--text", str(text_file), "--no-progress"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_generate_streams_and_prints_bytes(model_dir, capsys):
    rc = main(["generate", "hello there", "--model", str(model_dir), "--kv", "dynamic",
               "--max-new-tokens", "6", "--raw"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "KV cache dynamic:" in out and "+ 6 new tokens" in out and "total " in out


@pytest.mark.parametrize("device", ["cpu", "auto"] + (["cuda"] if torch.cuda.is_available() else []))
def test_generate_on_a_device(model_dir, capsys, device):
    rc = main(["generate", "hello there", "--model", str(model_dir), "--kv", "best-4",
               "--max-new-tokens", "4", "--raw", "--device", device])
    assert rc == 0
    assert "KV cache best-4:" in capsys.readouterr().out


def test_generate_bad_input_exit_2(model_dir, capsys):
    assert main(["generate", "hi", "--model", str(model_dir), "--kv", "int9"]) == 2
    assert "unknown KV config 'int9'" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model_dir), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0: allowed" in capsys.readouterr().err


def test_generate_offloads_blocks_to_the_named_tier(model_dir, capsys, tmp_path):
    store = tmp_path / "kv"
    prompt = " ".join(f"w{i % 50}" for i in range(700))  # long enough to seal blocks
    rc = main(["generate", prompt, "--model", str(model_dir), "--kv", "int4", "--raw",
               "--max-new-tokens", "4", "--offload", f"disk:{store}", "--kv-budget", "100KiB"])
    assert rc == 0
    out = capsys.readouterr().out
    tiers = out.split("tiers: ", 1)[1].splitlines()[0]
    assert tiers.startswith("device") and "disk " in tiers
    assert not tiers.endswith("disk 0 B"), out  # quantized blocks went down to disk
    assert "instead of computed: 0" in out
    # the same prompt again over the same store: the prompt's state is loaded, not computed,
    # and greedy decoding continues exactly as before
    rc = main(["generate", prompt, "--model", str(model_dir), "--kv", "int4", "--raw",
               "--max-new-tokens", "4", "--offload", f"disk:{store}", "--kv-budget", "100KiB"])
    again = capsys.readouterr().out
    assert rc == 0 and again.split("\n--- KV cache")[0] == out.split("\n--- KV cache")[0]
    n_prompt = int(out.split("--- KV cache int4: ", 1)[1].split(" prompt")[0])
    assert f"instead of computed: {n_prompt - 1}" in again, again


def test_generate_offload_bad_input_exit_2(model_dir, capsys):
    assert main(["generate", "hi", "--model", str(model_dir), "--kv-budget", "1MiB"]) == 2
    assert "needs --offload" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model_dir), "--kv", "dynamic",
                 "--offload", "host"]) == 2
    assert "needs a lessmem preset" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model_dir), "--offload", "floppy"]) == 2
    assert "offload tier 'floppy' is not understood" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model_dir), "--offload", "host",
                 "--kv-budget", "lots"]) == 2
    assert "lots" in capsys.readouterr().err


def test_generate_offload_options_are_shared_with_eval(model_dir, capsys, tmp_path):
    prompt = " ".join(f"w{i % 50}" for i in range(400))
    rc = main(["generate", prompt, "--model", str(model_dir), "--kv", "int4", "--raw", "--max-new-tokens", "2",
               "--offload", f"host@16K,disk:{tmp_path / 'kv'}", "--kv-budget", "64K", "--block-tokens", "64",
               "--no-prefetch"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "tiers: " in x)
    assert "budget 64.00 KiB" in line  # a bare K is KiB, as for plan
    host = line.split("host ", 1)[1].split(",")[0]
    assert host != "0 B" and "disk " in line
    assert main(["generate", "hi", "--model", str(model_dir), "--offload", "host", "--block-tokens", "33"]) == 2
    assert "block_tokens=33; allowed: a positive multiple of int4's block_size 32" in capsys.readouterr().err


def test_eval_passkey_too_short_for_the_tokenizer_fails_before_the_perplexity(model_dir, text_file, capsys,
                                                                              monkeypatch):
    import lessmem.eval.perplexity

    def evaluate(*a, **k):
        raise AssertionError("the perplexity ran before --passkey was checked")

    monkeypatch.setattr(lessmem.eval.perplexity, "evaluate", evaluate)
    assert main(_eval(model_dir, text_file, "--kv", "int4", "--passkey", "100")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lessmem eval: error: --passkey 100: n_tokens=100 is too short for a passkey prompt; "
                          "allowed: >= "), err


def test_generate_prefills_a_long_prompt_in_chunks(model_dir, capsys, monkeypatch):
    # without --offload a long prompt goes through the model a chunk at a time (its
    # activations held one chunk at a time); generate then takes its last token
    import lessmem.kvcache.cache as kv_cache

    seen = []
    real = kv_cache.prefill_chunks
    monkeypatch.setattr(kv_cache, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(kv_cache, "prefill_chunks", lambda m, c, ids, *a: seen.append(ids.shape[1]) or real(m, c, ids, *a))
    prompt = " ".join(f"w{i % 50}" for i in range(300))
    for kv in ("best-4", "dynamic"):
        assert main(["generate", prompt, "--model", str(model_dir), "--kv", kv, "--raw", "--max-new-tokens", "3"]) == 0
        n_prompt = int(capsys.readouterr().out.split(f"--- KV cache {kv}: ", 1)[1].split(" prompt")[0])
        assert seen.pop() == n_prompt - 1 > 64
    assert main(["generate", "hello there", "--model", str(model_dir), "--raw", "--max-new-tokens", "2"]) == 0
    assert not seen  # a short prompt: one forward, as before
