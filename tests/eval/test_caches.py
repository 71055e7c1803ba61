"""Cache specs and byte measurement: baseline, lessmem presets, peers."""

import pytest
import torch
from transformers import DynamicCache

from lessmem.eval import CacheSpec, evaluate, measure_memory, memory_at_length, resolve_configs
from lessmem.eval.caches import available_peers, cache_kwarg, lessmem_presets, resolve_config
from lessmem.models import tiny_random, tiny_tokenizer

TEXT = "".join(f"record {i}; value={i * 37 % 101}; status ok.\n" for i in range(300))


@pytest.fixture(scope="module")
def model():
    return tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1)


def _fill(model, cache, n):
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, **{cache_kwarg(model): cache})
    return cache


def test_dynamic_bytes_are_counted_from_tensors(model):
    mem = measure_memory(_fill(model, DynamicCache(config=model.config), 40))
    # 2 layers x (K + V) x [1, 1, 40, 64] float32
    assert mem["total"] == 2 * 2 * 40 * 64 * 4
    assert mem["fp16_equivalent"] == 2 * 2 * 40 * 64 * 2
    assert mem["k_bits"] == mem["v_bits"] == 32.0


def test_resolve_names_and_errors():
    assert resolve_config("dynamic").kind == "baseline"
    assert [s.name for s in resolve_configs("dynamic, int4")] == ["dynamic", "int4"]
    with pytest.raises(ValueError, match="unknown KV config 'int5'; allowed: dynamic"):
        resolve_config("int5")
    with pytest.raises(ValueError, match="preset name, a KVConfig or a CacheSpec"):
        resolve_config(4)
    spec = CacheSpec("x", lambda cfg: DynamicCache(config=cfg))
    assert resolve_config(spec) is spec


def test_fp16_preset_equals_dynamic_and_int4_is_smaller(model):
    tok = tiny_tokenizer()
    rows = {r["config"]: r for r in evaluate(model, tok, ["fp16", "int4"], TEXT, 1, 320, 16)}
    assert rows["fp16"]["kld"] == pytest.approx(0.0, abs=1e-6)
    assert rows["fp16"]["top1"] == 1.0
    assert rows["int4"]["kv_bytes"] < rows["int4"]["fp16_kv_bytes"]
    assert 4.0 < rows["int4"]["k_bits"] < 5.0


def test_kvconfig_object_is_named_after_its_preset():
    presets = lessmem_presets()
    assert resolve_config(presets["int4"]).name == "int4"


@pytest.mark.skipif("quanto-int4" not in available_peers(), reason="optimum-quanto not installed")
def test_quanto_peer_bytes(model):
    cache = resolve_config("quanto-int4").make(model.config)
    mem = measure_memory(_fill(model, cache, 200))
    # quanto int4, groups of 64 with a float32 scale and shift each: 4 + 64/64 = 5 bits
    assert mem["k_bits"] == pytest.approx(5.0)
    assert mem["quantized"] > 0 and mem["total"] < mem["fp16_equivalent"] * 2
    assert mem["fp16_equivalent"] == 2 * 2 * 200 * 64 * 2


@pytest.mark.skipif("hf-fp8" not in available_peers(), reason="this transformers has no fp8 QuantizedCache")
def test_fp8_peer_runs_in_protocol(model):
    tok = tiny_tokenizer()
    r = {x["config"]: x for x in evaluate(model, tok, ["hf-fp8"], TEXT, 1, 64, 8)}["hf-fp8"]
    assert r["k_bits"] == pytest.approx(8.0, abs=0.01)
    assert r["compression"] == pytest.approx(2.0, rel=0.01)


def test_memory_at_length_counts_what_is_held(model):
    spec = resolve_config("dynamic")
    m = memory_at_length(spec, model.config, 300, chunk=64)
    assert m["total"] == 2 * 2 * 300 * 64 * 4 and m["fp16_equivalent"] == m["total"] // 2
    with pytest.raises(ValueError, match="n_tokens=0; allowed: an integer >= 1"):
        memory_at_length(spec, model.config, 0)


def test_lessmem_cache_bytes_at_length_shrink(model):
    m = memory_at_length(resolve_config("int4"), model.config, 2048)
    assert m["fp16_equivalent"] == 2 * 2 * 2048 * 64 * 2
    assert m["total"] < m["fp16_equivalent"] / 2.5  # 4-bit codes + metadata + window + sinks


def test_expand_kv_keywords():
    from lessmem.eval.cli import MAIN_PRESETS, expand_kv

    if available_peers():
        assert expand_kv("peers") == available_peers()
    else:  # e.g. transformers 4.56 without optimum-quanto: 'peers' names nothing
        with pytest.raises(ValueError, match="--kv peers: names no config"):
            expand_kv("peers")
    assert expand_kv("presets") == list(lessmem_presets())
    assert expand_kv("int4,int4,hf-fp8") == ["int4", "hf-fp8"]
    assert expand_kv(None, full=True) == list(MAIN_PRESETS)


def test_default_eval_is_the_quick_run_and_full_is_the_main_table(model, tmp_path):
    from lessmem.cli import build_parser
    from lessmem.eval.cli import FULL_PROTOCOL, MAIN_PRESETS, QUICK_PRESETS, QUICK_PROTOCOL, check

    model.save_pretrained(tmp_path)  # checked (its config read), never loaded
    quick = build_parser("eval").parse_args(["eval", "--model", str(tmp_path)])
    check(quick)
    assert [s.name for s in quick.configs] == list(QUICK_PRESETS)
    assert (quick.windows, quick.window_len) == QUICK_PROTOCOL == (1, 512)
    full = build_parser("eval").parse_args(["eval", "--model", str(tmp_path), "--full"])
    check(full)
    assert [s.name for s in full.configs] == list(MAIN_PRESETS)
    assert (full.windows, full.window_len) == FULL_PROTOCOL == (2, 1024)
    # an explicit option still wins over --full
    mixed = build_parser("eval").parse_args(["eval", "--model", str(tmp_path), "--full",
                                             "--kv", "int4", "--windows", "3"])
    check(mixed)
    assert [s.name for s in mixed.configs] == ["int4"] and (mixed.windows, mixed.window_len) == (3, 1024)


def _accepts(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_cache_kwarg_is_the_one_the_installed_forward_takes(arch):
    # transformers 5.24 renamed past_key_values= to cache= (the old name warns, and is
    # removed from forward in 5.40); older releases only know past_key_values=
    m = tiny_random(arch)
    kw = cache_kwarg(m)
    assert kw in ("cache", "past_key_values") and _accepts(m.forward, kw)
    if _accepts(m.forward, "cache"):
        assert kw == "cache"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning from lessmem's own calls
        with torch.inference_mode():
            cache = resolve_config("int4").make(m.config)
            out = m(torch.tensor([[1, 2, 3, 4]]), **{kw: cache}, use_cache=True)
            m.generate(torch.tensor([[1, 2, 3]]), **{kw: DynamicCache(config=m.config)},
                       max_new_tokens=2, do_sample=False)
    assert out.logits.shape[1] == 4 and cache.get_seq_length() == 4


def test_a_peer_backend_this_transformers_lacks_is_refused_by_name(monkeypatch):
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils, "Fp8QuantizedLayer", raising=False)
    assert "hf-fp8" not in available_peers()
    with pytest.raises(ValueError, match="peer cache 'hf-fp8' needs transformers' fp8 QuantizedCache "
                                         "backend, which transformers .* does not have"):
        resolve_config("hf-fp8")
