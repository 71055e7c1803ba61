"""The evaluation protocol on a tiny random model: exactness, noise, bytes, bad input."""

import math
import time

import pytest
import torch
from transformers import DynamicCache

from lessmem.eval import CacheSpec, evaluate, make_windows
from lessmem.eval._reference import reference_kld, reference_ppl
from lessmem.eval.caches import cache_kwarg
from lessmem.eval.perplexity import check_protocol
from lessmem.models import tiny_random, tiny_tokenizer

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(200))


@pytest.fixture(scope="module")
def model():
    return tiny_random("llama", hidden_size=128, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class NoisyCache(DynamicCache):
    """A DynamicCache that stores keys with added Gaussian noise."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        g = torch.Generator().manual_seed(1000 + layer_idx + key_states.shape[-2])
        key_states = key_states + 0.5 * torch.randn(key_states.shape, generator=g)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _by_name(rows):
    return {r["config"]: r for r in rows}


def test_dynamic_vs_itself_is_exact(model, tok):
    copy = CacheSpec("dynamic-copy", lambda cfg: DynamicCache(config=cfg))
    rows = _by_name(evaluate(model, tok, [copy], TEXT, windows=2, window_len=96, chunk=16))
    assert list(rows) == ["dynamic", "dynamic-copy"]
    for r in rows.values():
        assert r["delta_ppl_pct"] == pytest.approx(0.0, abs=1e-9)
        assert r["kld"] == pytest.approx(0.0, abs=1e-9)
        assert r["top1"] == 1.0
    assert rows["dynamic-copy"]["ppl"] == pytest.approx(rows["dynamic"]["ppl"], rel=1e-9)


def test_noise_gives_positive_kld_and_lower_agreement(model, tok):
    noisy = CacheSpec("noisy", lambda cfg: NoisyCache(config=cfg))
    r = _by_name(evaluate(model, tok, [noisy], TEXT, windows=2, window_len=96, chunk=8))["noisy"]
    assert r["kld"] > 1e-6
    assert r["top1"] < 1.0
    assert r["delta_ppl_pct"] != 0.0


def test_baseline_matches_full_forward_reference(model, tok):
    ids = make_windows(tok, TEXT, 2, 80)
    ref = reference_ppl(model, ids, prefill=80 // 4)
    for chunk in (1, 7, 16):
        r = evaluate(model, tok, [], ids.reshape(-1), windows=2, window_len=80, chunk=chunk)[0]
        assert r["ppl"] == pytest.approx(ref, rel=1e-4), chunk


def test_scored_tokens_and_protocol_fields(model, tok):
    rows = evaluate(model, tok, [], TEXT, windows=3, window_len=64, chunk=5, model_name="tiny", text_name="t")
    r = rows[0]
    assert r["tokens_scored"] == 3 * (64 - 16)
    assert (r["model"], r["text"], r["windows"], r["window_len"], r["chunk"], r["prefill"]) == ("tiny", "t", 3, 64, 5, 16)
    # fp32 DynamicCache: 64 tokens x 2 layers x 1 kv head x 64 dims x (K+V) x 4 bytes
    assert r["kv_bytes"] == 64 * 2 * 1 * 64 * 2 * 4
    assert r["fp16_kv_bytes"] == r["kv_bytes"] // 2
    assert r["k_bits"] == r["v_bits"] == 32.0
    assert r["tok_per_s"] > 0 and math.isfinite(r["ppl"])


def test_kld_accumulation_matches_reference(model, tok):
    # one window, chunk covering everything after the prefill: the protocol's KLD over
    # the chunk positions must equal the probability-space reference on the same logits
    ids = make_windows(tok, TEXT, 1, 48)
    noisy = CacheSpec("noisy", lambda cfg: NoisyCache(config=cfg))
    r = _by_name(evaluate(model, tok, [noisy], ids.reshape(-1), windows=1, window_len=48, chunk=64))["noisy"]
    P = 12
    with torch.inference_mode():
        logits = []
        for c in (DynamicCache(config=model.config), NoisyCache(config=model.config)):
            a = model(ids[:, :P], **{cache_kwarg(model): c}).logits[0, -1:]
            b = model(ids[:, P:], **{cache_kwarg(model): c}).logits[0, :-1]
            logits.append(torch.cat([a, b]))
    assert r["kld"] == pytest.approx(reference_kld(*logits), rel=1e-4, abs=1e-9)


def test_time_budget_stops_after_a_window(model, tok):
    r = evaluate(model, tok, [], TEXT, windows=4, window_len=32, chunk=8, time_budget_s=0.0)[0]
    assert r["windows"] == 1 and r["tokens_scored"] == 32 - 8


def test_progress_reaches_total(model, tok):
    seen = []
    evaluate(model, tok, [], TEXT, windows=2, window_len=32, chunk=8, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == 2 * (1 + 3)


@pytest.mark.parametrize("kw, match", [
    (dict(windows=0), "windows=0"),
    (dict(window_len=4), "window_len=4; allowed: an integer >= 8"),
    (dict(chunk=0), "chunk=0; allowed: an integer >= 1"),
    (dict(window_len=True), "window_len=True"),
])
def test_bad_protocol_raises(model, tok, kw, match):
    args = dict(windows=1, window_len=32, chunk=4) | kw
    with pytest.raises(ValueError, match=match):
        evaluate(model, tok, [], TEXT, **args)


def test_text_too_short_and_bad_configs(model, tok):
    with pytest.raises(ValueError, match="the text has .* tokens"):
        evaluate(model, tok, [], "short", windows=1, window_len=32, chunk=4)
    with pytest.raises(ValueError, match="unknown KV config 'nope'; allowed: dynamic"):
        evaluate(model, tok, ["nope"], TEXT, windows=1, window_len=32, chunk=4)
    with pytest.raises(ValueError, match="must be unique"):
        evaluate(model, tok, ["int4", "int4"], TEXT, windows=1, window_len=32, chunk=4)
    with pytest.raises(ValueError, match="a string or a 1-D tensor"):
        make_windows(tok, 123, 1, 32)
    with pytest.raises(TypeError, match="warmup='no'; allowed: True or False"):
        evaluate(model, tok, [], TEXT, windows=1, window_len=32, chunk=4, warmup="no")
    check_protocol(1, 8, 1)  # the smallest allowed protocol passes


def test_windows_from_a_prefix_equal_full_tokenization():
    tok = tiny_tokenizer()
    full = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    w = make_windows(tok, TEXT, 3, 100)
    assert torch.equal(w.reshape(-1), full[:300])


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_sliding_window_models(arch, tok):
    m = tiny_random(arch, num_layers=4, sliding_window=16)
    ids = make_windows(tok, TEXT, 2, 96)
    rows = evaluate(m, tok, ["int4"], ids.reshape(-1), windows=2, window_len=96, chunk=8)
    assert rows[0]["ppl"] == pytest.approx(reference_ppl(m, ids, 24), rel=1e-4)
    # sliding layers hold at most 16 tokens: less than 96 tokens in every layer
    assert rows[0]["fp16_kv_bytes"] < 4 * 2 * 2 * 96 * 16 * 2
    for r in rows[1:]:
        assert math.isfinite(r["ppl"]) and r["kv_bytes"] > 0


def _first_use_spec(delay: float) -> CacheSpec:
    """A DynamicCache whose first decode step (the first update onto a non-empty cache,
    over every cache the spec builds) sleeps ``delay`` s, as a kernel's first use would."""
    paid = []

    class FirstUse(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if not paid and self.get_seq_length(layer_idx) > 0:
                paid.append(True)
                time.sleep(delay)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return CacheSpec("first-use", lambda cfg: FirstUse(config=cfg))


def test_warm_up_keeps_the_first_use_out_of_tok_per_s(model, tok):
    delay = 0.5
    kw = dict(windows=1, window_len=64, chunk=8)
    warm = _by_name(evaluate(model, tok, [_first_use_spec(delay)], TEXT, **kw))["first-use"]
    cold = _by_name(evaluate(model, tok, [_first_use_spec(delay)], TEXT, warmup=False, **kw))["first-use"]
    fed = 64 - 16
    # without the warm-up the delay lands inside the timed chunk forwards; with it, outside
    assert fed / cold["tok_per_s"] >= delay
    assert fed / warm["tok_per_s"] < delay
    assert warm["first_use_s"] >= 0.8 * delay and warm["warmup"] is True
    assert math.isnan(cold["first_use_s"]) and cold["warmup"] is False
    # the warm-up uses a throwaway cache: the scores are the same either way
    assert warm["ppl"] == cold["ppl"] and warm["kld"] == cold["kld"]


def test_log_names_each_warm_up_and_window(model, tok):
    lines = []
    noisy = CacheSpec("noisy", lambda cfg: NoisyCache(config=cfg))
    evaluate(model, tok, [noisy], TEXT, windows=2, window_len=32, chunk=8, log=lines.append)
    assert lines == ["warm-up dynamic (1/2)", "warm-up noisy (2/2)",
                     "window 1/2: 32 tokens through 2 caches", "window 2/2: 32 tokens through 2 caches"]
