"""`lessmem plan --offload`: the planner's tier split equals what a real TieredKVCache places."""

import json
from types import SimpleNamespace

import pytest

from lessmem import cli
from lessmem.base.tierspec import parse_offload_spec
from lessmem.base.units import parse_bytes
from lessmem.plan import plan
from lessmem.plan.kv import get_kv
from lessmem.plan.models import get_model
from lessmem.plan.tiers import quantized_bytes, tier_split

# preset, block_size, window, block_tokens, budget, prefetch, tokens, prefill chunk, decode tokens
# (a negative count: that many tokens in chunks of 8, as lessmem eval feeds its windows)
CASES = [
    ("int4", 16, 16, 32, 40_000, True, 300, 64, 40),    # chunked prefill, then decoding
    ("int4", 16, 16, 32, 30_000, True, 320, 80, -240),  # eval's protocol: a quarter, then chunks of 8
    ("int4", 16, 16, 16, 90_000, False, 300, 16, 0),    # the device keeps many blocks
    ("kivi-2", 32, 32, 64, 20_000, True, 260, 230, 30),  # one-shot prefill (as generate does)
    ("best-4", 64, 96, 64, 90_000, False, 300, 64, 40),
    ("int4", 32, 128, 64, 1_000_000, True, 300, 64, 8),   # everything fits on the device
]


def _real(cfg, n, budget, offload, bt, prefetch, pchunk, decode, dchunk):
    import torch

    from lessmem.kvcache.tiered import TieredKVCache, cache_kwargs
    from lessmem.models import tiny_random
    from lessmem.offload import DiskTier, build_tier

    torch.manual_seed(0)
    model = tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1)
    ids = torch.randint(1, 200, (1, n))
    host, disk = parse_offload_spec(offload)  # the planner's string, built here without fsync (speed)
    tiers = [build_tier(host), DiskTier(disk.target, disk.capacity, fsync=False)]
    cache = TieredKVCache(model.config, cfg, tiers=tiers, device_budget=budget, block_tokens=bt,
                          prefetch=prefetch)
    prompt = n - decode
    with torch.inference_mode():  # SDPA over the gathered history: the same reads, no kernel build
        for a in range(0, prompt, pchunk):
            model(ids[:, a:min(a + pchunk, prompt)], **cache_kwargs(model, cache))
        for t in range(prompt, n, dchunk):
            model(ids[:, t:t + dchunk], **cache_kwargs(model, cache))
    out = {"blocks": {t.name: len(list(t.keys())) for t in cache.stack.tiers},
           "bytes": cache.stack.placement(), "over_budget": cache.over_budget,
           "resident": cache.fp_bytes(), "config": model.config}
    cache.close()
    return out


@pytest.mark.parametrize("preset, bs, window, bt, budget, prefetch, n, pchunk, decode", CASES)
def test_split_matches_a_real_tiered_cache(tmp_path, preset, bs, window, bt, budget, prefetch, n,
                                           pchunk, decode):
    pytest.importorskip("torch")
    from lessmem.kvcache import PRESETS

    cfg = PRESETS[preset].replace(window=window, block_size=bs)
    offload = f"host@6KiB,disk:{tmp_path}"
    dchunk = 8 if decode < 0 else 1
    decode = abs(decode)
    real = _real(cfg, n, budget, offload, bt, prefetch, pchunk, decode, dchunk)
    c = real["config"]
    dims = SimpleNamespace(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=64)
    s = tier_split(dims, cfg.to_plan(preset), n, 1, budget, offload, bt, prefetch, pchunk, decode,
                   decode_chunk=dchunk)
    bb = s["block_bytes"]
    got = {t["tier"]: t for t in s["tiers"]}
    assert {k: t["blocks"] for k, t in got.items()} == real["blocks"]  # the same block in each tier
    for k in ("device", "host"):  # memory tiers hold the raw tensors: bytes within one block
        assert abs(got[k]["bytes"] - real["bytes"][k]) <= bb, (k, got[k], real["bytes"])
    # a disk block is its tensors plus a small header and checksum (under 1 KiB)
    assert 0 <= real["bytes"]["disk"] - got["disk"]["bytes"] < 1024 * got["disk"]["blocks"] + 1
    assert s["resident_bytes"] == real["resident"]
    assert s["within_budget"] == (real["over_budget"] == 0)
    assert s["blocks"] == sum(real["blocks"].values()) and s["lost_blocks"] == 0


def test_block_bytes_are_what_the_cache_stores():
    pytest.importorskip("torch")
    import torch

    from lessmem.kvcache import PRESETS
    from lessmem.kvcache.tiered import TieredKVCache
    from lessmem.models import tiny_random

    model = tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1)
    for preset in ("int4", "kivi-2", "best-2"):
        cache = TieredKVCache(model.config, preset, tiers="host", block_tokens=128)
        for layer in range(2):
            k = torch.randn(2, 1, 400, 64)  # batch 2
            cache.update(k, k.clone(), layer)
        la = cache.tiered[0]
        dims = SimpleNamespace(layers=2, kv_heads=1, head_dim=64)
        assert la.block_bytes == [quantized_bytes(dims, PRESETS[preset].to_plan(preset), 128, 2)] * 2
        cache.close()


def test_unbounded_budget_keeps_everything_on_the_device_and_last_tier_overflow_is_lost():
    m, p = get_model("smollm2-135m"), get_kv("kivi-2")
    s = tier_split(m, p, 4096, offload="disk:/tmp/kv")
    assert [(t["tier"], t["blocks"]) for t in s["tiers"]] == [("device", s["blocks"]), ("disk", 0)]
    assert s["blocks"] == 30 * ((4096 - 128) // 256) and s["within_budget"] and s["kv_budget"] is None
    tight = tier_split(m, p, 4096, kv_budget="8MiB", offload="host@1MiB")
    assert tight["lost_blocks"] > 0 and not tight["fits"]
    host = tight["tiers"][1]
    assert host["blocks"] == (1 << 20) // tight["block_bytes"] and host["bytes"] <= 1 << 20


def test_one_shot_prefill_leaves_the_device_tier_empty():
    """generate feeds the whole prompt at once: the new tokens' reserve empties the device tier,
    and blocks are never promoted back, so only blocks sealed while decoding stay there."""
    m, p = get_model("smollm2-135m"), get_kv("lessmem:int4")
    chunked = tier_split(m, p, 8192, kv_budget="64MiB", offload="host")
    one_shot = tier_split(m, p, 8192, kv_budget="64MiB", offload="host", prefill_chunk=8192)
    assert chunked["tiers"][0]["blocks"] > 0 and one_shot["tiers"][0]["blocks"] == 0
    assert not one_shot["within_budget"] and one_shot["needed_budget"] > 64 << 20


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fp16"), "is not quantized"),
    (dict(precision="lessmem:int4:skip=2"), "skip_layers=2"),
    (dict(block_tokens=48), "block_tokens=48; allowed: a positive multiple of lessmem:int4's block size 32"),
    (dict(decode_tokens=4096), "decode_tokens=4096; allowed: fewer than context=4096"),
    (dict(offload="device,host"), "names the device tier"),
    (dict(offload="floppy"), "offload tier 'floppy' is not understood"),
    (dict(kv_budget="lots"), "kv_budget='lots' is not a size"),
    (dict(prefill_chunk=0), "prefill_chunk=0; allowed: an integer >= 1"),
    (dict(decode_chunk=0), "decode_chunk=0; allowed: an integer >= 1"),
])
def test_tier_split_rejects(kwargs, match):
    args = dict(precision="lessmem:int4", offload="host")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tier_split(get_model("smollm2-135m"), get_kv(args.pop("precision")), 4096, **args)


def test_plan_cli_prints_the_split_and_the_arguments_to_pass_on(capsys):
    argv = ["plan", "--model", "smollm2-135m", "--context", "8k", "--kv", "kivi-2,fp16",
            "--kv-budget", "16M", "--offload", "host@8MiB,disk:/tmp/kv", "--json"]
    assert cli.main(argv) == 0
    p = json.loads(capsys.readouterr().out)
    (sp,) = p["tier_split"]  # fp16 (a bare precision) gets no split
    assert sp["precision"] == "kivi-2" and sp["kv_budget"] == 16 << 20  # bare M = MiB
    assert sum(t["blocks"] for t in sp["tiers"]) == sp["blocks"]
    args = sp["args"].split()
    assert args == ["--kv", "kivi-2", "--kv-budget", "16MiB", "--offload", "host@8MiB,disk:/tmp/kv",
                    "--block-tokens", "256"]
    assert parse_offload_spec(args[5]) == parse_offload_spec("host@8MiB,disk:/tmp/kv")
    assert parse_bytes(args[3]) == 16 << 20
    assert cli.main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "Tier split — kivi-2" in out and "pass to lessmem generate / eval: --kv kivi-2" in out


def test_plan_offload_defaults_to_int4_and_needs_a_preset(capsys):
    p = plan("smollm2-135m", context=2048, kv_budget="4MiB", offload="host")
    assert [s["precision"] for s in p["tier_split"]] == ["lessmem:int4"]
    assert cli.main(["plan", "--model", "smollm2-135m", "--kv", "fp16,int4", "--offload", "host"]) == 2
    err = capsys.readouterr().err
    assert "offload needs a quantized lessmem cache preset in kv, got fp16, int4; allowed:" in err


def test_plan_with_offload_never_imports_torch(run_torch_free):
    r = run_torch_free("from lessmem import cli;"
                       "cli.main(['plan', '--json', '--model', 'smollm2-135m', '--kv', 'best-4', '--kv-budget', '8MiB',"
                       "          '--offload', 'host@1GiB,disk:/tmp/kv,redis://127.0.0.1:6379/0'])")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tier_split"][0]["tiers"][-1]["tier"] == "remote"
