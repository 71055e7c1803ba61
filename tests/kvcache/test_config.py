"""KVConfig / KVTensorConfig validation, serialization, presets."""

from __future__ import annotations

import pytest

from lessmem.formats import PerChannel, PerGroup, PerToken
from lessmem.kvcache import PRESETS, KVConfig, KVTensorConfig, resolve
from lessmem.kvcache.config import NONE


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name):
    cfg = PRESETS[name]
    assert KVConfig.from_dict(cfg.to_dict()) == cfg
    assert resolve(name) is cfg and resolve(cfg) is cfg


def test_effective_bits_match_the_formula():
    assert KVTensorConfig("uint", 4, PerGroup(64, axis=-2)).effective_bits(64) == 4 + 24 / 64
    assert KVTensorConfig("int", 8, PerToken()).effective_bits(64) == 8 + 16 / 64
    assert KVTensorConfig("uint", 2, PerGroup(32)).effective_bits(64) == 2 + 24 / 32
    assert NONE.effective_bits(64) == 16
    kb, vb = PRESETS["best-4"].effective_bits(64)
    assert kb <= 4.6 and vb <= 4.6
    kb, vb = PRESETS["best-2"].effective_bits(64)
    assert (kb + vb) / 2 <= 3.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(format="int7"), r"format='int7'; allowed: none, int, uint, fp8-e4m3, fp8-e5m2, lm"),
    (dict(format="int", bits=5), r"bits=5 for format 'int'; allowed: 2, 3, 4, 8"),
    (dict(format="fp8-e4m3", bits=4), r"bits=4 for format 'fp8-e4m3'; allowed: 8"),
    (dict(format="lm", bits=8), r"bits=8 for format 'lm'; allowed: 2, 3, 4"),
    (dict(format="uint", bits=4, granularity=PerChannel(0)), r"granularity=.*allowed: PerGroup\(G, axis=-2\)"),
    (dict(format="uint", bits=4, granularity=PerGroup(8, axis=0)), r"allowed: PerGroup\(G, axis=-2\)"),
    (dict(format="uint", bits=4, clip_ratio=0.2), r"clip_ratio=0.2; allowed: a number in \[0.5, 1.0\]"),
])
def test_bad_tensor_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVTensorConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=-1), r"window=-1; allowed: an integer >= 0"),
    (dict(sinks=1.5), r"sinks=1.5; allowed: an integer >= 0"),
    (dict(block_size=0), r"block_size=0; allowed: an integer >= 1"),
    (dict(sliding="drop"), r"sliding='drop'; allowed: exact, quantize"),
    (dict(window_dtype="fp64"), r"window_dtype='fp64'; allowed: fp16, bf16, fp32, model"),
    (dict(keys="int4"), r"keys='int4'; allowed: a KVTensorConfig"),
    (dict(keys=KVTensorConfig("uint", 4, PerGroup(64, axis=-2)), block_size=32),
     r"block_size=32 must be a multiple of the per-channel token group 64; allowed: block sizes 64, 128"),
    (dict(layer_overrides=((0, "int8", "int8"),)), r"layer_overrides entry .*allowed: \(layer, KVTensorConfig"),
    (dict(skip_layers=(-1,)), r"skip_layers entry=-1; allowed: an integer >= 0"),
])
def test_bad_kv_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVConfig(**kwargs)


def test_layer_overrides_and_skips():
    hi = KVTensorConfig("int", 8, PerToken())
    cfg = KVConfig(skip_layers=(1,), layer_overrides=((0, hi, hi),))
    assert cfg.for_layer(0) == (hi, hi)
    assert cfg.for_layer(1) == (NONE, NONE)
    assert cfg.for_layer(2) == (cfg.keys, cfg.values)
    assert KVConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="needs num_layers"):
        cfg.to_plan()
    with pytest.raises(ValueError, match="change more than the bits .* cannot be described to the planner"):
        cfg.to_plan(num_layers=3)  # int8 overrides a uint4 base: another zero point, not only bits


def test_mixed_quantized_and_none_sides_are_refused():
    from lessmem.kvcache.layer import QuantizedKVLayer

    cfg = KVConfig(keys=NONE)
    with pytest.raises(ValueError, match="allowed: both quantized or both 'none'"):
        QuantizedKVLayer(cfg, 0)


def test_a_preset_name_takes_field_changes_after_colons(tmp_path):
    import json

    got = resolve("best-4:sliding=quantize:window=64:rotate_values=true")
    assert got == PRESETS["best-4"].replace(sliding="quantize", window=64, rotate_values=True)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(PRESETS["int8"].to_dict()))
    assert resolve(f"{path}:sinks=0") == PRESETS["int8"].replace(sinks=0)
    from lessmem.eval.caches import resolve_config

    spec = resolve_config("best-4:sliding=quantize")
    assert spec.name == "best-4:sliding=quantize" and spec.config.sliding == "quantize"
    for bad, match in (("best-4:color=red", "field one of window"), ("best-4:window", "field=value"),
                       ("best-4:window=-1", "integer >= 0"), ("best-4:rotate_keys=maybe", "true or false"),
                       ("best-4:sliding=drop", "'best-4:sliding=drop': sliding='drop'; allowed: exact"),
                       ("best-4:block_size=48", "block_size=48"), ("int9:window=3", "unknown KV preset")):
        with pytest.raises(ValueError, match=match):
            resolve(bad)
