"""The planner's KV bytes against a real lessmem KV cache (issue 3: within 2%).

For every preset of ``lessmem.kvcache``: the planner's torch-free table holds the same
KVPrecision that ``KVConfig.to_plan`` derives, and ``kv_bytes`` for the built-in model's
KV shape (30 layers, 3 KV heads, head_dim 64) matches ``KVCache.memory()["total"]`` after
filling the cache, at several lengths, within 2% (it is exact today).
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
kvcache = pytest.importorskip("lessmem.kvcache")
transformers = pytest.importorskip("transformers")

from lessmem.plan import KV_PRESETS, get_kv, get_model, kv_bytes  # noqa: E402
from lessmem.plan.kv import RAW  # noqa: E402

BYTE_FIELDS = [f.name for f in dataclasses.fields(get_kv("fp16"))
               if f.name not in ("name", "quality", "description")]


def _plan_name(name: str) -> str:
    return f"lessmem:{name}" if name in RAW else name


def test_every_cache_preset_is_in_the_planner_table():
    for name, cfg in kvcache.PRESETS.items():
        assert _plan_name(name) in KV_PRESETS, name
        ours, theirs = KV_PRESETS[_plan_name(name)], cfg.to_plan(name)
        for f in BYTE_FIELDS:
            assert getattr(ours, f) == getattr(theirs, f), (
                f"preset {name!r} field {f}: planner {getattr(ours, f)!r} vs cache {getattr(theirs, f)!r}; "
                "update lessmem.plan.kv.LESSMEM (torch-free copy of lessmem.kvcache.PRESETS)")


@pytest.fixture(scope="module")
def smol_config():
    return transformers.LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                                    num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                                    vocab_size=49152)


@pytest.mark.parametrize("name", sorted(kvcache.PRESETS))
def test_planner_matches_the_cache_within_2_percent(name, smol_config):
    torch.set_num_threads(1)
    model = get_model("smollm2-135m")
    cache = kvcache.KVCache(smol_config, name, attention="reference")
    dtype = torch.float16 if name == "fp16" else torch.float32  # fp16 keeps the model dtype
    g = torch.Generator().manual_seed(0)
    length = 0
    for chunk in (300, 1, 700, 37):  # prefill, one decode step, more prefill, a ragged tail
        for layer in range(model.layers):
            k = torch.randn(2, model.kv_heads, chunk, model.head_dim, generator=g).to(dtype)
            cache.update(k, torch.randn_like(k), layer)
        length += chunk
        held = cache.memory()["total"]
        planned = kv_bytes(model, length, 2, get_kv(_plan_name(name)))["total"]
        assert abs(planned - held) <= 0.02 * held, (name, length, planned, held)


def test_plan_accepts_a_kvconfig():
    from lessmem.plan import plan

    cfg = kvcache.PRESETS["kivi-2"].replace(window=64)
    r = plan("smollm2-135m", context=4096, kv=[cfg])["kv"][0]
    assert r["precision"] == "custom" and r["full_precision_tokens"] == 64
