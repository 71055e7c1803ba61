"""`lessmem eval --offload/--kv-budget`: a tiered cache scores exactly like the in-memory one,
and the rows say where the bytes were (bytes per tier, device peak vs budget)."""

import json

import pytest
import torch

from lessmem.cli import main
from lessmem.eval.caches import placement, resolve_config, with_offload
from lessmem.eval.perplexity import evaluate
from lessmem.kvcache import PRESETS
from lessmem.models import tiny_random, tiny_tokenizer

torch.set_num_threads(1)

TEXT = "".join(f"Paragraph {i}: numbers {i * i} and {i + 3}.\n" for i in range(300))
SCORES = ("ppl", "delta_ppl_pct", "kld", "top1", "k_bits", "v_bits", "kv_bytes", "fp16_kv_bytes",
          "tokens_scored")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1), tiny_tokenizer()


@pytest.mark.parametrize("preset, bs", [("int4", 16), ("kivi-2", 32)])
def test_tiered_perplexity_equals_in_memory(tiny, tmp_path, preset, bs):
    model, tok = tiny
    cfg = PRESETS[preset].replace(window=16, block_size=bs)  # short window: most tokens quantized
    mem_spec = resolve_config(cfg)
    # small blocks; a budget far below the quantized history, so most blocks leave the device
    tiered = with_offload(mem_spec, f"host@4KiB,disk:{tmp_path / 'kv'}", "40KiB", block_tokens=bs)
    a = evaluate(model, tok, [mem_spec], TEXT, windows=2, window_len=192, chunk=8)[1]
    b = evaluate(model, tok, [tiered], TEXT, windows=2, window_len=192, chunk=8)[1]
    assert a["config"] == b["config"] and "offload" not in a
    for k in SCORES:
        assert a[k] == b[k], k  # bit-exact: the same logits, so the same sums
    off = b["offload"]
    assert set(off["tiers"]) == {"device", "host", "disk"}
    assert off["tiers"]["host"] > 0 and off["tiers"]["disk"] > 0, off
    assert off["tiers"]["host"] <= 4096
    assert off["device_budget"] == 40 * 1024 and off["device_peak"] <= off["device_budget"]
    assert off["within_budget"] is True
    # every quantized byte is in exactly one tier, the rest (window, sinks, partial block) on the device
    assert sum(off["tiers"].values()) <= b["kv_bytes"] < sum(off["tiers"].values()) + off["device_bytes"]
    assert list((tmp_path / "kv" / "blocks").rglob("*.blk")) == []  # closed caches leave no session blocks


def test_over_budget_is_reported_not_hidden(tiny, tmp_path):
    model, tok = tiny
    spec = with_offload(resolve_config(PRESETS["int4"].replace(window=16, block_size=16)), "host",
                        "1KiB", block_tokens=16)  # below what the window alone needs
    row = evaluate(model, tok, [spec], TEXT, windows=1, window_len=96, chunk=8)[1]
    off = row["offload"]
    assert off["device_peak"] > off["device_budget"] and off["within_budget"] is False
    assert off["tiers"]["device"] == 0 and off["tiers"]["host"] > 0


def test_placement_of_plain_cache_is_none():
    assert placement({"total": 10}) is None


def test_with_offload_validation():
    with pytest.raises(ValueError, match="needs a lessmem preset or KVConfig, got 'dynamic'"):
        with_offload(resolve_config("dynamic"), "host")
    with pytest.raises(ValueError, match="names the device tier"):
        with_offload(resolve_config("int4"), "device@1MiB,host")
    with pytest.raises(ValueError, match="block_tokens=48; allowed: a positive multiple of int4's block_size 32"):
        with_offload(resolve_config("int4"), "host", block_tokens=48)
    with pytest.raises(ValueError, match="--kv-budget='lots' is not a size"):
        with_offload(resolve_config("int4"), "host", "lots")
    with pytest.raises(ValueError, match="offload tier 'floppy' is not understood"):
        with_offload(resolve_config("int4"), "floppy")


# ------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("tiny-llama-offload")
    tiny[0].save_pretrained(d)
    tiny[1].save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text-offload") / "t.txt"
    f.write_text(TEXT)
    return f


def _eval(model_dir, text_file, *extra):
    # int4 keeps a 128-token window and 4 sinks: 384 tokens leave 224-255 quantized per layer
    return ["eval", "--model", str(model_dir), "--text", str(text_file), "--windows", "1",
            "--window-len", "384", "--chunk", "32", "--no-progress", "--kv", "int4,hf-fp8", *extra]


def test_eval_cli_offload_json(model_dir, text_file, tmp_path, capsys):
    assert main(_eval(model_dir, text_file, "--json")) == 0
    plain = {r["config"]: r for r in json.loads(capsys.readouterr().out)}
    store = tmp_path / "kv"
    assert main(_eval(model_dir, text_file, "--json", "--offload", f"host@8K,disk:{store}",
                      "--kv-budget", "96KiB", "--block-tokens", "64")) == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["dynamic", "int4", "hf-fp8"]
    assert "offload" not in rows["dynamic"] and "offload" not in rows["hf-fp8"]  # stay in memory
    for k in ("ppl", "kld", "top1", "kv_bytes"):
        assert rows["int4"][k] == plain["int4"][k], k
    off = rows["int4"]["offload"]
    assert off["device_budget"] == 96 * 1024 and off["tiers"]["host"] <= 8 * 1024  # bare K = KiB
    assert off["tiers"]["disk"] > 0 and off["within_budget"] == (off["device_peak"] <= 96 * 1024)
    assert rows["int4"]["detail"]["offload"] == f"host@8K,disk:{store}"
    assert rows["int4"]["detail"]["block_tokens"] == 64


def test_eval_cli_offload_table(model_dir, text_file, tmp_path, capsys):
    assert main(_eval(model_dir, text_file, "--offload", f"disk:{tmp_path}", "--no-prefetch")) == 0
    out = capsys.readouterr().out
    assert "prefetch off" in out and "256 tokens per block" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("int4") and "tiers:" in x)
    assert "budget none" in line and "disk 0 B" in line  # no budget: every block stays on the device


@pytest.mark.parametrize("extra, match", [
    (["--kv-budget", "1MiB"], "needs --offload"),
    (["--kv", "hf-fp8", "--offload", "host"], "--offload needs a lessmem preset in --kv, got hf-fp8; allowed"),
    (["--offload", "floppy"], "offload tier 'floppy' is not understood"),
    (["--offload", "host", "--kv-budget", "lots"], "--kv-budget lots: allowed: a size"),
    (["--offload", "host", "--block-tokens", "40"], "block_tokens=40; allowed: a positive multiple"),
])
def test_eval_cli_offload_bad_input_exit_2(model_dir, text_file, capsys, extra, match):
    assert main(_eval(model_dir, text_file, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


def test_eval_cli_offload_to_redis(model_dir, text_file, redis_server, capsys):
    """The remote tier end to end: blocks go to a real (private, loopback) redis-server and
    are removed when the cache closes; the scores stay those of the in-memory cache."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        assert main(_eval(model_dir, text_file, "--json", "--kv", "int4")) == 0
        plain = json.loads(capsys.readouterr().out)[1]
        assert main(_eval(model_dir, text_file, "--json", "--kv", "int4", "--offload", redis_server.url,
                          "--kv-budget", "80KiB", "--block-tokens", "32")) == 0
        row = json.loads(capsys.readouterr().out)[1]
        assert (row["ppl"], row["kld"], row["top1"]) == (plain["ppl"], plain["kld"], plain["top1"])
        assert row["offload"]["tiers"]["remote"] > 0, row["offload"]
        assert client.dbsize() == 0  # the closed cache removed its session blocks
    finally:
        client.close()
