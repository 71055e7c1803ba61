"""The cache and the fused attention on architectures other than Llama (issue 15).

Each model is a tiny random instance of the real transformers class (built offline from
its config): Gemma-2 (sliding and global layers mixed, attention-logit soft-capping, one
KV head of head_dim 256), Gemma-3 (QK-norm, sliding/global mix, one KV head of 256),
Qwen3 (QK-norm), Qwen2 (attention biases; large key outliers injected through the key
bias), Phi and Phi-3 (partial rotary), Mixtral and Qwen2-MoE (MoE MLPs). Every one is
checked against ``DynamicCache`` on the same tokens (a prefill, then token-by-token
decode past the full-precision window), and lessmem's fused attention against the
dequantized path on the same cache config.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from lessmem.formats import PerGroup, PerToken
from lessmem.kvcache import PRESETS, KVCache, KVConfig, KVTensorConfig, enable
from lessmem.kvcache.cache import cache_kwarg

COMMON = dict(vocab_size=272, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              max_position_embeddings=4096, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MIXED = ["sliding_attention", "full_attention"] * 2


def _config(arch: str):
    if arch == "gemma2":
        return tf.Gemma2Config(**COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                               sliding_window=16, layer_types=MIXED, attn_logit_softcapping=50.0)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                   sliding_window=16, layer_types=MIXED)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    if arch == "qwen2":
        return tf.Qwen2Config(**{**COMMON, "hidden_size": 256}, num_attention_heads=4, num_key_value_heads=2)
    if arch == "phi":
        return tf.PhiConfig(**COMMON, num_attention_heads=2, num_key_value_heads=2, partial_rotary_factor=0.5)
    if arch == "phi3":
        return tf.Phi3Config(**COMMON, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5)
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                num_experts_per_tok=2)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64)
    raise AssertionError(arch)


ARCHS = ["gemma2", "gemma3", "qwen3", "qwen2", "phi", "phi3", "mixtral", "qwen2_moe"]
_MODELS: dict = {}


def model_for(arch: str):
    if arch not in _MODELS:
        cfg = _config(arch.split("+")[0])
        if arch.endswith("+w48"):  # a window wider than a block and the full-precision window
            cfg.sliding_window = 48
        cfg._attn_implementation = "eager" if arch.startswith("gemma2") else "sdpa"  # SDPA cannot soft-cap
        with torch.random.fork_rng():
            torch.manual_seed(0)
            m = tf.AutoModelForCausalLM.from_config(cfg).eval()
        if arch == "qwen2+outliers":  # Qwen2's key bias carries large per-channel outliers in real models
            with torch.no_grad():
                for layer in m.model.layers:
                    layer.self_attn.k_proj.bias[[5, 64 + 6]] += 40.0  # channel 5 of head 0, 6 of head 1
        _MODELS[arch] = m
    return _MODELS[arch]


IDS = torch.randint(3, 270, (1, 184), generator=torch.Generator().manual_seed(0))
PREFILL = 150


def run(model, cache):
    """Logits of every position: a prefill of PREFILL tokens, then one token per step."""
    out = []
    with torch.no_grad():
        for s, e in ((0, PREFILL), *[(i, i + 1) for i in range(PREFILL, IDS.shape[1])]):
            r = model(input_ids=IDS[:, s:e], **{cache_kwarg(model): cache}, use_cache=True)
            out.append(r.logits)
    return torch.cat(out, dim=1)


def _small_window(name: str) -> KVConfig:
    # a window of 16 tokens: most of the 184 are read back from quantized blocks
    return PRESETS[name].replace(window=16)


@pytest.fixture(scope="module")
def reference():
    return {}


def _ref(reference, arch):
    if arch not in reference:
        m = model_for(arch)
        reference[arch] = run(m, DynamicCache(config=m.config))
    return reference[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp16_preset_equals_dynamic_cache(arch, reference):
    m = model_for(arch)
    got = run(m, KVCache(m.config, "fp16"))
    assert torch.equal(got, _ref(reference, arch))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("preset", ["int8", "best-4", "best-3"])
def test_quantized_cache_tracks_dynamic_and_fused_equals_dequantized(arch, preset, reference):
    m = model_for(arch)
    ref = _ref(reference, arch)
    kv = _small_window(preset)
    got = run(m, KVCache(m.config, kv))  # dequantized path (the model's own attention)
    assert torch.isfinite(got).all()
    dec = slice(PREFILL, None)  # the decode steps read the quantized history
    lp, lr = got[:, dec].log_softmax(-1), ref[:, dec].log_softmax(-1)
    kld = (lr.exp() * (lr - lp)).sum(-1).mean().item()
    # measured on these random models: int8 <= 1.3e-3 (Qwen2), best-4 <= 0.12 (Mixtral: a
    # flipped expert choice moves a token), best-3 <= 0.29 (Qwen2)
    assert kld < {"int8": 5e-3, "best-4": 0.3, "best-3": 0.6}[preset], kld
    assert kld > 1e-7  # the history really was quantized (not all in the window)
    with enable(m):
        fused = run(m, KVCache(m.config, kv))
    # Gemma-2's soft-capped logits go through the dequantized layer view, everything else
    # through the fused kernels; either way the same numbers as the dequantized path, up to
    # summation order, which these random models amplify: measured up to 3.5e-4 of the
    # largest logit (Qwen2, int8, one decode step; transformers 5.25), where the same cache
    # read by transformers' eager and SDPA attention differs by 2.5e-4
    scale = got.abs().max().item()
    assert (fused - got).abs().max().item() < 2e-3 * scale
    assert (fused - got).abs().mean().item() < 1e-5 * scale


def test_per_channel_keys_survive_qwen2_key_outliers():
    """KIVI's reason for per-channel keys, on Qwen2 with two outlier key channels (|k| ~ 40
    against ~1 elsewhere): per-token 4-bit steps of ~80/15 swamp the ordinary channels;
    per-channel groups keep them."""
    m = model_for("qwen2+outliers")
    dc = DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=IDS, **{cache_kwarg(m): dc}, use_cache=True)
    k, v = dc.layers[0].keys, dc.layers[0].values
    assert k.abs().amax() > 30  # the outliers are there after RoPE
    ordinary = [i for i in range(64) if i not in (5, 6, 37, 38)]  # 5 and 6 with their RoPE pairs
    errs = {}
    for name, keys in (("token", KVTensorConfig("uint", 4, PerToken())),
                       ("channel", KVTensorConfig("uint", 4, PerGroup(32, axis=-2)))):
        c = KVCache(m.config, KVConfig(keys=keys, values=KVTensorConfig("uint", 4), window=16, sinks=0,
                                       block_size=32))
        c.update(k[:, :, :-1], v[:, :, :-1], 0)
        kd, _ = c.update(k[:, :, -1:], v[:, :, -1:], 0)  # the history comes back dequantized
        q = slice(0, 160)  # the tokens stored in quantized blocks
        a, b = kd[:, :, q][..., ordinary], k[:, :, q][..., ordinary]
        errs[name] = ((a - b).norm() / b.norm()).item()
    assert errs["channel"] < 0.15 and errs["token"] > 4 * errs["channel"], errs  # measured 0.08 / 0.55


def test_gemma_sliding_layers_stay_bounded_and_global_layers_quantized():
    """Gemma-3's sliding layers keep transformers' bounded full-precision layer (the last
    sliding_window - 1 = 15 tokens); its global layers hold every token, quantized."""
    m = model_for("gemma3")
    c = KVCache(m.config, _small_window("best-4"))
    run(m, c)
    sliding, full = c.layers[0], c.layers[1]
    assert sliding.keys.shape[2] == m.config.sliding_window - 1
    mem = full.memory()
    assert mem["tokens"] == IDS.shape[1] and mem["codes"] > 0


class _KeepEverySlidingBlock(KVCache):
    """The quantized sliding layers as they were before they dropped anything: every block
    kept, the mask hiding what slid out (the reference the bounded layer must equal)."""

    def _new_sliding_layer(self, layer_idx, sliding_window):
        return self._new_layer(layer_idx)


# 4-bit keys per channel in groups of 16, rotated; blocks of 16 and a window of 8, so a
# 48-token sliding window reads quantized blocks it shares with the dropped ones
SLIDING_Q = KVConfig(keys=KVTensorConfig("uint", 4, PerGroup(16, axis=-2)), values=KVTensorConfig("uint", 4),
                     window=8, sinks=0, block_size=16, rotate_keys=True, sliding="quantize")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_quantized_sliding_layers_drop_what_slid_out(arch):
    """``sliding="quantize"``: a sliding layer keeps only the blocks its window can still
    see, so it holds under sliding_window + block_size tokens at any length, and the
    logits are exactly those of keeping every block with the mask hiding the old ones."""
    m = model_for(arch + "+w48")
    cache = KVCache(m.config, SLIDING_Q)
    got = run(m, cache)
    kept = _KeepEverySlidingBlock(m.config, SLIDING_Q)
    assert torch.equal(got, run(m, kept))
    W, B = m.config.sliding_window, SLIDING_Q.block_size
    for i in (0, 2):  # the sliding layers
        layer = cache.layers[i]
        assert type(layer).__name__ == "SlidingQuantizedKVLayer" and layer.is_sliding
        held = layer.length - layer.dropped
        assert layer.length == IDS.shape[1] and layer.dropped > 0 and held < W + B
        assert layer.n_history > 0  # the window sees quantized tokens, not only the full-precision ones
        assert layer.memory()["codes"] < kept.layers[i].memory()["codes"] / 2
        assert [b.start for b in layer.blocks()][0] == layer.dropped
    assert cache.memory()["total"] < kept.memory()["total"]
    ref = run(m, DynamicCache(config=m.config))
    dec = slice(PREFILL, None)
    lp, lr = got[:, dec].log_softmax(-1), ref[:, dec].log_softmax(-1)
    assert (lr.exp() * (lr - lp)).sum(-1).mean().item() < 0.05  # measured 4e-3 / 7e-3
    with enable(m):
        fused = run(m, KVCache(m.config, SLIDING_Q))
    assert (fused - got).abs().max().item() < 1e-4 * got.abs().max().item()


def test_quantized_sliding_layer_edge_cases():
    """Full precision through the bounded sliding layers matches DynamicCache; a sliding layer
    in ``skip_layers`` stays bounded beside quantized ones (one mask serves them all); the
    cache's sinks do not apply to sliding layers; crops stop at the full-precision window."""
    m = model_for("gemma3+w48")
    ref = run(m, DynamicCache(config=m.config))
    fp = KVCache(m.config, PRESETS["fp16"].replace(sliding="quantize"))
    torch.testing.assert_close(run(m, fp), ref, atol=1e-4, rtol=1e-4)  # measured 2e-6
    assert fp.layers[0].dropped > 0 and fp.layers[0].keys.shape[2] < 48 + 32
    cache = KVCache(m.config, SLIDING_Q.replace(skip_layers=(2,), sinks=4))
    got = run(m, cache)
    assert torch.isfinite(got).all()
    s0, s2 = cache.layers[0], cache.layers[2]
    assert s0.quantized and not s2.quantized and s0.dropped == s2.dropped > 0
    assert s0.config.sinks == 0 and cache.layers[1].config.sinks == 4
    win = s0.window[0].shape[2]
    with pytest.raises(ValueError, match="full-precision window"):
        cache.truncate_to(s0.length - win - 1)
    cache.truncate_to(s0.length - win)
    assert s0.length == s2.length == IDS.shape[1] - win
