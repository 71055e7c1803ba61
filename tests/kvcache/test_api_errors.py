"""Bad input to the KV-cache Python API (issue 14): one table per entry point.

Every row asserts the exception type, that the one-line message names the offending
value and says what is allowed, and (for calls on a filled cache) that the cache holds
exactly what it held before the refused call.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from lessmem.formats import PerGroup, PerToken
from lessmem.kvcache import PRESETS, KVCache, KVConfig, KVTensorConfig, resolve
from lessmem.kvcache import cache as cache_mod
from lessmem.kvcache.cache import cache_kwarg
from lessmem.kvcache.config import ConfigTypeError

LAYERS, HEADS, HEAD_DIM = 2, 2, 64  # the tiny llama of conftest.py
CFG = PRESETS["int4"].replace(window=16)  # 60 tokens: 4 sinks, one 32-token block, 24 in the window


def kv(tokens=5, batch=1, heads=HEADS, dim=HEAD_DIM, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, tokens, dim, generator=g, dtype=torch.float32).to(dtype)


def check(exc_info, exc, *fragments):
    """The exception is ``exc``, its message is one line holding every fragment and 'allowed'."""
    msg = str(exc_info.value)
    assert isinstance(exc_info.value, exc), (type(exc_info.value), msg)
    assert "\n" not in msg, msg
    assert "allowed" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.fixture()
def filled(llama):
    """A cache holding 60 tokens in every layer: sinks, quantized history and window."""
    cache = KVCache(llama.config, CFG, attention="reference")
    for i in range(LAYERS):
        cache.update(kv(60, seed=i), kv(60, seed=10 + i), i)
    return cache


def state(cache: KVCache) -> list:
    """Everything the cache holds, as plain values and tensor copies."""
    out = []
    for layer in cache.layers:
        out.append((layer.length, layer.n_history, layer.is_initialized))
        if layer.is_initialized:
            out += [t.clone() for t in (*layer.sinks, *layer.window)]
            out += [t.clone() for _, t in sorted((layer.history or {}).items())]
    return out


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# ---- constructor ---------------------------------------------------------------------------
def _tiered(arg):
    from lessmem.kvcache.tiered import TieredKVCache

    return TieredKVCache(arg, "int4")


CONSTRUCTOR = [
    ("none", lambda m: KVCache(None), TypeError, ["got None", "PretrainedConfig"]),
    ("empty-dict", lambda m: KVCache({}), TypeError, ["got a dict", "PretrainedConfig"]),
    ("model", lambda m: KVCache(m), TypeError, ["LlamaForCausalLM", "pass model.config"]),
    ("tiered-model", lambda m: _tiered(m), TypeError, ["LlamaForCausalLM", "pass model.config"]),
    ("tiered-none", lambda m: _tiered(None), TypeError, ["got None", "PretrainedConfig"]),
    ("config-int", lambda m: KVCache(m.config, 4), TypeError, ["KV config 4", "a preset name"]),
    ("config-dict", lambda m: KVCache(m.config, {"window": 8}), TypeError,
     ["{'window': 8}", "KVConfig.from_dict", "or a KVConfig"]),
    ("config-name", lambda m: KVCache(m.config, "int5"), ValueError, ["'int5'", "kivi-2"]),
    ("attention", lambda m: KVCache(m.config, attention="flash"), ValueError,
     ["attention='flash'", "auto, fused, reference"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in CONSTRUCTOR],
                         ids=[c[0] for c in CONSTRUCTOR])
def test_constructor_refuses(llama, call, exc, fragments):
    with pytest.raises(exc) as e:
        call(llama)
    check(e, exc, *fragments)


def test_config_type_errors_are_also_value_errors():
    # the CLI reports every bad config it catches as ValueError: it must keep catching these
    with pytest.raises(ValueError):
        resolve(4)
    assert issubclass(ConfigTypeError, TypeError) and issubclass(ConfigTypeError, ValueError)


# ---- calls on a filled cache: refused, and nothing changes -----------------------------------
ON_CACHE = [
    ("idx-past-end", lambda c: c.update(kv(), kv(), LAYERS), IndexError,
     [f"layer_idx={LAYERS}", f"has {LAYERS} layers", f"0..{LAYERS - 1}"]),
    ("idx-negative", lambda c: c.update(kv(), kv(), -1), IndexError, ["layer_idx=-1", "0..1"]),
    ("idx-str", lambda c: c.update(kv(), kv(), "0"), TypeError, ["layer_idx='0'", "integer 0..1"]),
    ("idx-bool", lambda c: c.update(kv(), kv(), True), TypeError, ["layer_idx=True", "0..1"]),
    ("idx-float", lambda c: c.update(kv(), kv(), 1.0), TypeError, ["layer_idx=1.0", "0..1"]),
    ("kv-lengths", lambda c: c.update(kv(5), kv(4), 0), ValueError,
     ["[1, 2, 5, 64]", "[1, 2, 4, 64]", "same shape, dtype and device"]),
    ("kv-head-dim", lambda c: c.update(kv(5), kv(5, dim=32), 1), ValueError,
     ["[1, 2, 5, 32]", "same shape"]),
    ("kv-dtypes", lambda c: c.update(kv(3), kv(3, dtype=torch.float16), 0), ValueError,
     ["float32", "float16", "same shape, dtype and device"]),
    ("k-list", lambda c: c.update([[0.0]], kv(), 0), TypeError, ["key_states is list", "tensor"]),
    ("v-3d", lambda c: c.update(kv(), kv()[0], 0), TypeError,
     ["value_states is [2, 5, 64]", "[batch, heads, tokens, head_dim]"]),
    ("k-int", lambda c: c.update(kv().long(), kv(), 0), TypeError,
     ["key_states is [1, 2, 5, 64] int64", "floating-point"]),
    ("new-batch", lambda c: c.update(kv(batch=2), kv(batch=2), 0), ValueError,
     ["[2, 2, 5, 64]", "batch 1", "same batch, heads, head_dim"]),
    ("new-heads", lambda c: c.update(kv(heads=4), kv(heads=4), 1), ValueError,
     ["[1, 4, 5, 64]", "heads 2"]),
    ("seq-length-idx", lambda c: c.get_seq_length(5), IndexError, ["layer_idx=5", "0..1"]),
    ("mask-sizes-idx", lambda c: c.get_mask_sizes(1, 7), IndexError, ["layer_idx=7", "0..1"]),
    ("max-length-idx", lambda c: c.get_max_length(9), IndexError, ["layer_idx=9", "0..1"]),
    ("crop-float", lambda c: c.crop(1.5), TypeError, ["crop(1.5)", "an integer"]),
    ("crop-str", lambda c: c.crop("-3"), TypeError, ["crop('-3')", "an integer"]),
    ("crop-remove-too-many", lambda c: c.crop(-61), ValueError,
     ["crop(-61)", "holds 60 tokens", "-60..-1"]),
    ("crop-length-too-long", lambda c: c.crop(61), ValueError, ["crop(61)", "1..60"]),
    ("crop-into-history", lambda c: c.crop(-30), ValueError,
     ["cannot crop 30 tokens", "only the 24 full-precision", "up to the window length"]),
    ("truncate-too-long", lambda c: c.truncate_to(61), ValueError,
     ["truncate_to(61)", "holds 60", "0..60"]),
    ("truncate-negative", lambda c: c.truncate_to(-1), ValueError, ["truncate_to(-1)", "0..60"]),
    ("truncate-bool", lambda c: c.truncate_to(True), TypeError, ["truncate_to(True)", "0..60"]),
    ("truncate-into-history", lambda c: c.truncate_to(10), ValueError,
     ["cannot crop 50 tokens", "up to the window length"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in ON_CACHE],
                         ids=[c[0] for c in ON_CACHE])
def test_calls_on_a_filled_cache_refuse_and_change_nothing(filled, call, exc, fragments):
    before = state(filled)
    with pytest.raises(exc) as e:
        call(filled)
    check(e, exc, *fragments)
    assert_same(state(filled), before)


def test_accepted_neighbours_of_the_refused_inputs(filled):
    """numpy integers are integers; crop's three forms name the same final length."""
    filled.update(kv(2), kv(2), np.int64(1))
    filled.update(kv(2), kv(2), np.int32(0))
    assert filled.get_seq_length(np.int64(1)) == 62
    filled.crop(np.int64(-1))
    assert filled.get_seq_length() == 61
    filled.crop(60)  # positive: the length to keep
    assert filled.get_seq_length() == 60
    filled.truncate_to(np.int16(58))
    filled.crop(0)  # nothing to remove
    assert [layer.length for layer in filled.layers] == [58, 58]


def test_sliding_layer_refusal_leaves_every_layer_as_it_was():
    """A model whose second layer is transformers' sliding layer: past its window it cannot
    crop (no past recording), so nothing is cropped, quantized layers included."""
    from kvhelpers import tiny

    model = tiny("qwen2", 40)
    cache = KVCache(model.config, PRESETS["int4"].replace(window=64), attention="reference")
    assert [type(layer).__name__ for layer in cache.layers] == ["QuantizedKVLayer",
                                                                "DynamicSlidingWindowLayer"]
    for i in range(2):
        cache.update(kv(60, seed=i), kv(60, seed=5 + i), i)
    keys0 = cache.layers[0].window[0].clone()
    keys1 = cache.layers[1].keys.clone()
    with pytest.raises(ValueError) as e:
        cache.crop(-5)
    check(e, ValueError, "truncate_to(55)", "layer 1", "activate_past_recording")
    assert [layer.get_seq_length() for layer in cache.layers] == [60, 60]
    assert torch.equal(cache.layers[0].window[0], keys0)
    assert torch.equal(cache.layers[1].keys, keys1)


# ---- KVTensorConfig / KVConfig fields ------------------------------------------------------
NAN = float("nan")
CONFIGS = [
    ("bits-str", lambda: KVTensorConfig("int", "4"), TypeError,
     ["bits='4'", "an integer, one of 2, 3, 4, 8", "got a str"]),
    ("bits-float", lambda: KVTensorConfig("uint", 4.0), TypeError, ["bits=4.0", "2, 3, 4, 8"]),
    ("bits-bool", lambda: KVTensorConfig("fp8-e4m3", True), TypeError, ["bits=True", "8"]),
    ("bits-none-format", lambda: KVTensorConfig("none", "16"), TypeError, ["bits='16'", "integer"]),
    ("format-int", lambda: KVTensorConfig(4), ValueError, ["format=4", "none, int, uint"]),
    ("clip-str", lambda: KVTensorConfig(clip_ratio="1"), TypeError,
     ["clip_ratio='1'", "a number in [0.5, 1.0]"]),
    ("clip-bool", lambda: KVTensorConfig(clip_ratio=True), TypeError, ["clip_ratio=True", "[0.5, 1.0]"]),
    ("clip-nan", lambda: KVTensorConfig(clip_ratio=NAN), ValueError, ["clip_ratio=nan", "[0.5, 1.0]"]),
    ("window-str", lambda: KVConfig(window="128"), TypeError,
     ["window='128'", "an integer >= 0", "got a str"]),
    ("window-float", lambda: KVConfig(window=128.0), TypeError, ["window=128.0", "integer >= 0"]),
    ("sinks-none", lambda: KVConfig(sinks=None), TypeError, ["sinks=None", "integer >= 0"]),
    ("block-bool", lambda: KVConfig(block_size=True), TypeError, ["block_size=True", "integer >= 1"]),
    ("seed-str", lambda: KVConfig(rotation_seed="0"), TypeError, ["rotation_seed='0'", "integer"]),
    ("seed-negative", lambda: KVConfig(rotation_seed=-2), ValueError, ["rotation_seed=-2", ">= 0"]),
    ("rotate-yes", lambda: KVConfig(rotate_keys="yes"), TypeError,
     ["rotate_keys='yes'", "True or False", "got a str"]),
    ("rotate-one", lambda: KVConfig(rotate_values=1), TypeError, ["rotate_values=1", "True or False"]),
    ("rotate-none", lambda: KVConfig(rotate_keys=None), TypeError, ["rotate_keys=None", "True or False"]),
    ("skip-int", lambda: KVConfig(skip_layers=3), TypeError, ["skip_layers=3", "a tuple or list"]),
    ("skip-str", lambda: KVConfig(skip_layers="0,1"), TypeError, ["skip_layers='0,1'", "tuple or list"]),
    ("skip-entry-str", lambda: KVConfig(skip_layers=("1",)), TypeError,
     ["skip_layers entry='1'", "integer >= 0"]),
    ("overrides-pair", lambda: KVConfig(layer_overrides=[(0, KVTensorConfig())]), TypeError,
     ["layer_overrides entry (0, KVTensorConfig", "(layer, KVTensorConfig, KVTensorConfig)"]),
    ("overrides-layer-str", lambda: KVConfig(layer_overrides=[("0", PRESETS["int8"].keys,
                                                                 PRESETS["int8"].values)]),
     TypeError, ["layer_overrides layer='0'", "integer >= 0"]),
    ("sliding-none", lambda: KVConfig(sliding=None), ValueError, ["sliding=None", "exact, quantize"]),
    ("window-dtype-int", lambda: KVConfig(window_dtype=16), ValueError,
     ["window_dtype=16", "fp16, bf16, fp32, model"]),
    ("keys-dict", lambda: KVConfig(keys={"format": "int"}), TypeError,
     ["keys={'format': 'int'}", "a KVTensorConfig"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_config_fields_refuse(call, exc, fragments):
    with pytest.raises(exc) as e:
        call()
    check(e, exc, *fragments)


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


GOOD = PRESETS["kivi-4"].to_dict()
FROM_DICT = [
    ("unknown-key", lambda: KVConfig.from_dict({**GOOD, "windw": 64}), ValueError,
     ["unknown keys 'windw'", "exactly the keys KVConfig.to_dict() writes", "window_dtype"]),
    ("missing-key", lambda: KVConfig.from_dict(_without(GOOD, "sinks")), ValueError,
     ["missing keys sinks", "KVConfig(...)"]),
    ("not-a-dict", lambda: KVConfig.from_dict("kivi-4"), TypeError,
     ["KVConfig.from_dict('kivi-4')", "a dict as written by KVConfig.to_dict()"]),
    ("keys-missing-bits", lambda: KVConfig.from_dict({**GOOD, "keys": _without(GOOD["keys"], "bits")}),
     ValueError, ["missing keys bits", "KVTensorConfig.to_dict()"]),
    ("keys-str-bits", lambda: KVConfig.from_dict({**GOOD, "keys": {**GOOD["keys"], "bits": "4"}}),
     TypeError, ["bits='4'", "2, 3, 4, 8"]),
    ("granularity-str", lambda: KVTensorConfig.from_dict({**GOOD["values"], "granularity": "token"}),
     TypeError, ["granularity='token'", "Granularity.to_dict()"]),
    ("granularity-field", lambda: KVTensorConfig.from_dict(
        {**GOOD["values"], "granularity": {"kind": "PerGroup", "sise": 32}}), ValueError,
     ["'sise': 32", "Granularity.to_dict()"]),
    ("override-entry", lambda: KVConfig.from_dict({**GOOD, "layer_overrides": [[0, GOOD["keys"]]]}),
     ValueError, ["layer_overrides entry [0, {", "[layer, keys dict, values dict]"]),
    ("skip-int", lambda: KVConfig.from_dict({**GOOD, "skip_layers": 1}), TypeError,
     ["skip_layers=1", "a tuple or list"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in FROM_DICT],
                         ids=[c[0] for c in FROM_DICT])
def test_from_dict_refuses(call, exc, fragments):
    with pytest.raises(exc) as e:
        call()
    check(e, exc, *fragments)


def test_numpy_values_are_stored_as_plain_python_values():
    cfg = KVConfig(keys=KVTensorConfig("uint", np.int64(4), PerGroup(32, axis=-2)),
                   values=KVTensorConfig("uint", np.int8(4), PerToken(), np.float32(1.0)),
                   window=np.int64(128), sinks=np.int32(0), rotate_keys=np.bool_(False),
                   skip_layers=[np.int64(3)])
    assert cfg == PRESETS["kivi-4"].replace(skip_layers=(3,))
    assert type(cfg.window) is int and type(cfg.keys.bits) is int and type(cfg.rotate_keys) is bool
    assert type(cfg.values.clip_ratio) is float and type(cfg.skip_layers[0]) is int
    assert KVConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---- cache_kwarg ---------------------------------------------------------------------------
class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None):
        return input_ids


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None):
        return input_ids


class _Both(torch.nn.Module):
    def forward(self, input_ids, cache=None, past_key_values=None):
        return input_ids


class _Wrapper(torch.nn.Module):
    def forward(self, *args, **kwargs):
        return args


def test_cache_kwarg_follows_the_forward_signature():
    library = cache_mod._library_cache_kwarg()
    assert cache_kwarg(_Old()) == "past_key_values"
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwarg(_Both()) == library  # both listed: the installed transformers' name
    assert cache_kwarg(_Wrapper()) == library  # neither listed: the same
    # decided once per class: a later change to the class is not looked at again
    assert cache_mod._CACHE_KWARG[_Old] == "past_key_values"
    with pytest.raises(TypeError) as e:
        cache_kwarg(None)
    check(e, TypeError, "None has no forward method", "a transformers model")


def test_cache_kwarg_of_a_real_model_raises_no_deprecation_warning(llama):
    import transformers
    from packaging.version import Version

    name = cache_kwarg(llama)
    if Version(transformers.__version__) >= Version("5.24"):
        assert name == "cache"
    forward, generate = KVCache(llama.config, "int4"), KVCache(llama.config, "int4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        llama(torch.tensor([[1, 2, 3]]), **{name: forward})
        llama.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=0, **{name: generate})
    assert forward.get_seq_length() == 3 and generate.get_seq_length() == 4
