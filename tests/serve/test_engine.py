"""The serving engine on real transformers models: identical outputs alone and batched,
under a budget that forces preemption (recompute and swap), with prefix hits, across a
restart on a disk tier; bytes counted once for shared pages; bad input refused first."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lessmem.formats import PerGroup
from lessmem.kvcache import PRESETS, KVTensorConfig
from lessmem.models import tiny_random
from lessmem.serve import Engine, EngineConfig, SamplingParams
from lessmem.serve.batch import BatchCache, Segment

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_random("llama")


def prompts(n, length=150, shared=0):
    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, 256, (shared,), generator=g).tolist()
    return [head + torch.randint(0, 256, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def run(model, ps, params=GREEDY, **cfg):
    cfg.setdefault("kv", "int4")
    cfg.setdefault("chunk_tokens", 64)
    cfg.setdefault("step_tokens", 128)
    with Engine(model, None, EngineConfig(**cfg)) as e:
        reqs = [e.submit(p, params) for p in ps]
        while e.step():
            pass
        return [r.output_ids for r in reqs], e.metrics()


def alone(model, ps, **cfg):
    return [run(model, [p], **cfg)[0][0] for p in ps]


# per-layer bits (lessmem.eval.allocate's kind of config): layer 1 at 4/3 bits, layer 0 at best-2's 3/2
MIXED = PRESETS["best-2"].replace(layer_overrides=(
    (1, KVTensorConfig("uint", 4, PerGroup(64, axis=-2)), KVTensorConfig("uint", 3)),))


# bits per key channel (lessmem.eval.channels' kind of config): each KV head its own channel order
_CB = KVTensorConfig("uint", 4, PerGroup(64, axis=-2), channel_bits=(4,) * 8 + (0,) * 8,
                     channel_order=(*range(16), *reversed(range(16))))
CHANNELS = PRESETS["best-2"].replace(rotate_keys=False, layer_overrides=(
    (0, _CB, KVTensorConfig("uint", 2)), (1, _CB, KVTensorConfig("uint", 3))))


@pytest.mark.parametrize("kv", ["int4", "best-4", "best-2", "fp16", MIXED, CHANNELS],
                         ids=["int4", "best-4", "best-2", "fp16", "mixed", "channels"])
def test_batched_outputs_equal_each_request_alone(model, kv):
    ps = prompts(5)
    batched, m = run(model, ps, kv=kv)
    assert m["max_running"] == 5 and m["requests_finished"] == 5
    assert batched == alone(model, ps, kv=kv)


@pytest.mark.parametrize("first_closed", ["other", "held"])
def test_two_engines_on_one_model_leave_each_other_invariant_whatever_closes_first(first_closed):
    """bench_serve builds its batched engine, then an engine for the alone references, and
    closes that one first: its close must not take the batch-invariant linears or lessmem's
    attention from the engine still open (it did: 4 of 12 requests matched alone)."""
    torch.manual_seed(0)
    model = tiny_random("llama")
    own = model.config._attn_implementation
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ps = prompts(4)
    cfg = EngineConfig(kv="best-4", chunk_tokens=64, step_tokens=128)
    held, other = Engine(model, None, cfg), Engine(model, None, cfg)
    first, second = (other, held) if first_closed == "other" else (held, other)
    first.close()
    assert model.config._attn_implementation == "lessmem"
    assert all("forward" in m.__dict__ for m in linears)  # the invariant forward, still installed
    reqs = [second.submit(p, GREEDY) for p in ps]
    while second.step():
        pass
    assert [r.output_ids for r in reqs] == alone(model, ps, kv="best-4")
    second.close()
    assert model.config._attn_implementation == own
    assert not any("forward" in m.__dict__ or "_lessmem_row_plans" in m.__dict__ for m in linears)


def test_attention_switches_nest_and_close_in_any_order():
    from lessmem.kvcache import enable

    model = tiny_random("llama")
    own = model.config._attn_implementation
    a, b = enable(model), enable(model)
    a.disable()
    a.disable()  # a second call gives nothing back twice
    assert model.config._attn_implementation == "lessmem"
    with enable(model):
        pass
    assert model.config._attn_implementation == "lessmem"
    b.disable()
    assert model.config._attn_implementation == own


@pytest.mark.parametrize("weights", ["fp8", "rtn4"])
def test_quantized_weights_batched_equal_alone(weights):
    """The row plan covers lessmem's quantized linears too (FP8Linear's matmul depends on its
    neighbours above one row, like the others' decoded-weight path)."""
    import lessmem

    torch.manual_seed(0)
    m = tiny_random("llama")
    cfg = lessmem.FP8Config(act="fp8") if weights == "fp8" else lessmem.RTNConfig(bits=4, group_size=32)
    lessmem.quantize_(m, cfg, progress=False)
    ps = prompts(4)
    batched, _ = run(m, ps, kv="best-4")
    assert batched == alone(m, ps, kv="best-4")


@pytest.mark.parametrize("kv", ["best-4", "fp16"])
def test_lean_steps_equal_the_forward_and_each_request_alone(kv):
    """A model with GGUF weights and lessmem's lean decode switch (what ``lessmem.load`` gives)
    takes the steps of decode rows only without transformers' forward
    (``LeanDecode.serve_step``; rows over a quantized history attend without the step's views,
    ``_rows_attend``): at every such step the logits equal the model's own forward
    on copies of the caches bit for bit, and the tokens equal the forward path's and each
    request's alone."""
    import lessmem
    from lessmem.weights.gguf_linear import set_int8_activations

    torch.manual_seed(0)
    m = tiny_random("llama")
    lessmem.quantize_(m, lessmem.GGUFConfig("Q4_0"), progress=False)
    set_int8_activations(m, True)  # (as lessmem.load sets it for Q4_0 files)
    ps = prompts(5)
    forward, m0 = run(m, ps, kv=kv)
    with lessmem.lean_decode(m) as switch:
        lean_step, compared = switch.serve_step, []

        def both(ids, positions, cache):  # the model's own forward on copies of the caches, then the lean step
            copies = [Segment(s.start, s.end, copy.deepcopy(s.cache), s.chunk) for s in cache.segments]
            with torch.inference_mode():
                ref = type(m).forward(m, input_ids=ids.view(1, -1), position_ids=positions.view(1, -1),
                                      cache=BatchCache(copies, len(cache.layers)), use_cache=True).logits[0]
            out = lean_step(ids, positions, cache)
            compared.append(torch.equal(out, ref))
            return out

        switch.serve_step = both
        rows_attend, direct = switch._rows_attend, []

        def counted(*args):  # the rows' attention without the step's views (a quantized history)
            out = rows_attend(*args)
            direct.append(out is not None)
            return out

        switch._rows_attend = counted
        lean, m1 = run(m, ps, kv=kv)
        solo = alone(m, ps, kv=kv)
    assert lean_step(torch.tensor([1]), torch.tensor([5]), None) is None  # switched off: the model's forward
    assert m0["lean_steps"] == 0 and m1["lean_steps"] > 0 and switch.serve_steps >= m1["lean_steps"]
    assert m1["max_running"] == 5 and len(compared) >= m1["lean_steps"] and all(compared)  # logits bit for bit
    assert lean == forward == solo
    assert any(direct) == (kv == "best-4")  # fp16 holds no quantized history: the views' path


def test_lean_steps_take_the_rows_a_recomputed_request_replays(monkeypatch):
    """A request preempted by recompute replays its output tokens one a step, unsampled; such
    steps still take the lean path (the replayed rows' logits dropped), and every request's
    tokens equal its own run alone."""
    import lessmem
    from lessmem.weights.gguf_linear import set_int8_activations

    torch.manual_seed(0)
    m = tiny_random("llama")
    lessmem.quantize_(m, lessmem.GGUFConfig("Q4_0"), progress=False)
    set_int8_activations(m, True)
    ps, params = prompts(4), SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    solo = [run(m, [p], params, kv="best-4")[0][0] for p in ps]
    per_request = run(m, ps, params, kv="best-4", prefix_cache=False)[1]["peak_device_bytes"] / 4
    schedule, replaying, lean_with_replays = Engine._schedule, [], []

    def recorded(self):
        batch = schedule(self)
        replaying.append(any(not chunk and not due for _, _, chunk, due in batch))
        return batch

    monkeypatch.setattr(Engine, "_schedule", recorded)
    with lessmem.lean_decode(m) as switch:
        lean_step = switch.serve_step

        def counted(ids, positions, cache):
            out = lean_step(ids, positions, cache)
            lean_with_replays.append(replaying[-1] and out is not None)
            return out

        switch.serve_step = counted
        out, m1 = run(m, ps, params, kv="best-4", kv_budget=int(per_request * 2), preempt="recompute",
                      prefix_cache=False)
    assert m1["recomputes"] > 0 and any(lean_with_replays)
    assert out == solo


def test_fp16_engine_equals_transformers_generate(model):
    ps = prompts(3)
    out, _ = run(model, ps, kv="fp16")
    for p, o in zip(ps, out, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(p):].tolist()
        assert o == ref


def test_budget_limits_running_and_recompute_keeps_outputs(model):
    ps = prompts(6)
    free, m_free = run(model, ps)
    per_request = m_free["peak_device_bytes"] / 6
    tight, m = run(model, ps, kv_budget=int(per_request * 2.5), preempt="recompute")
    assert tight == free
    assert m["max_running"] < 6
    assert m["peak_device_bytes"] <= int(per_request * 2.5) * 1.05


def test_swap_to_host_keeps_outputs_and_offloads_pages(model):
    # a short window: the pages (what moves to the host) are most of a request's bytes, not
    # the full-precision window's buffer (which stays on the device)
    ps, kv = prompts(6), "int4:window=32"
    free, m_free = run(model, ps, kv=kv)
    budget = int(m_free["peak_device_bytes"] / 6 * 2.5)
    out, m = run(model, ps, kv=kv, kv_budget=budget, offload="host@64MiB", preempt="swap")
    assert out == free
    assert m["demoted_pages"] > 0 or m["preemptions"] > 0
    assert m["max_running"] > run(model, ps, kv=kv, kv_budget=budget, preempt="recompute")[1]["max_running"]


def test_prefix_snapshots_never_take_the_engine_over_its_budget(model):
    """A snapshot registered after a step (its window copied out of the layer's buffer) stays
    only in the budget's free part: after every step the engine holds at most its budget."""
    ps = prompts(6)
    peak = run(model, ps, prefix_cache=False)[1]["peak_device_bytes"]
    for f in (1.5, 2.5):
        budget, held = int(peak / 6 * f), []
        with Engine(model, None, EngineConfig(kv="int4", chunk_tokens=64, step_tokens=128, kv_budget=budget)) as e:
            for p in ps:
                e.submit(p, GREEDY)
            while e.step():
                held.append(e.device_bytes())
            assert e.metrics()["over_budget_steps"] == 0
        assert max(held) <= budget


def test_a_decode_token_that_completes_a_block_is_budgeted(model):
    """The window's buffer stays when a block moves into the pages, so that step adds the
    block's pages at once: the step's estimate counts them, and no step goes over the budget
    (this case went 1,408 bytes over when each decode token was counted in full precision)."""
    ps, params = prompts(6), SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    peak = run(model, ps, params, prefix_cache=False)[1]["peak_device_bytes"]
    budget = int(peak / 6 * 3)
    out, m = run(model, ps, params, kv_budget=budget, prefix_cache=False)
    assert m["preemptions"] > 0 and m["over_budget_steps"] == 0 and m["peak_device_bytes"] <= budget


@pytest.mark.parametrize("kv", ["best-4", "int4", "fp16", MIXED, PRESETS["int4"].replace(skip_layers=(1,))])
def test_request_bytes_are_what_a_request_holds(model, kv):
    """``request_bytes(n)`` equals the bytes a request's cache holds after ``n`` tokens (its
    pages and full-precision tensors, as ``device_bytes`` counts them), however the tokens
    came (prompt chunks, decode tokens, a chunk that moves several blocks at once); the
    window's buffer is its tokens rounded up to ``WINDOW_GRAIN``, never a whole block's room
    ahead; ``_peak_bytes`` is the most held on the way."""
    from lessmem.base.placement import WINDOW_GRAIN
    from lessmem.serve.paged import PagedKVCache

    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    with Engine(model, None, EngineConfig(kv=kv, chunk_tokens=64)) as e:
        for steps in ([1] * 300, [5, 64, 64, 1, 1, 200, 3, 1, 17], [400]):
            cache, n, held = PagedKVCache(cfg, e.kv, e.pool), 0, []
            for t in steps:
                for i in range(cfg.num_hidden_layers):
                    k = torch.randn(1, heads, t, dim, generator=g)
                    cache.update(k, k.clone(), i)
                n += t
                held.append(e.pool.device_bytes + cache.fp_bytes())
                assert held[-1] == e.request_bytes(n), (steps, n)
            if e.kv.keys.quantized and not e.kv.skip_layers:  # a short request: its window's tokens
                assert e.request_bytes(1) == (1 if e.kv.sinks else WINDOW_GRAIN) * e.fp_token_bytes
            cache.free()
        # the most held between two lengths, against a walk one token at a time
        walk = [e.request_bytes(m) for m in range(0, 420)]
        for n0, n1 in ((0, 1), (0, 300), (100, 196), (195, 196), (196, 300), (250, 419)):
            assert e._peak_bytes(n0, n1) == max(walk[n0 + 1:n1 + 1]), (n0, n1)


@pytest.mark.parametrize("kv", ["best-4", "fp16"])
def test_a_prefix_hit_budgets_the_copy_of_the_snapshot_tensors(model, kv):
    """A request that starts from a prefix snapshot shares its pages and its full-precision
    tensors until its first update copies them (a quantized cache's window into a buffer of
    its own, an unquantized cache's keys and values). ``device_bytes`` counts those tensors
    with the request and with the snapshot until then, so the step's estimate is what the
    request will hold less what is counted for it now (``_held``), exactly; admission counts
    only the pages as shared. (Counting the copy on top of that made bench_serve --quick
    evict the shared prompt's snapshot that a waiting request then computed again.)"""
    from lessmem.serve.paged import PagedKVCache, release_snapshot

    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)

    def fill(cache, n):
        for i in range(cfg.num_hidden_layers):
            k = torch.randn(1, heads, n, dim, generator=g)
            cache.update(k, k.clone(), i)

    with Engine(model, None, EngineConfig(kv=kv, chunk_tokens=64)) as e:
        src = PagedKVCache(cfg, e.kv, e.pool)
        fill(src, 192)
        states = src.snapshot()
        dst = PagedKVCache(cfg, e.kv, e.pool)
        dst.load_snapshot(states, e._probe)
        assert dst.fp_shared() and not src.fp_shared()
        held = e._held(SimpleNamespace(cache=dst, n_cached=192))  # (a request's fields _held reads)
        assert held == e._page_bytes(192) + dst.fp_bytes() <= e.request_bytes(192)
        before = e.pool.device_bytes + dst.fp_bytes()
        fill(dst, 64)  # the request's next chunk
        assert not dst.fp_shared()
        added = e.pool.device_bytes + dst.fp_bytes() - before
        assert added == e.request_bytes(256) - held > 0
        assert e._grow(192, 256, held) >= max(added, e._peak_bytes(192, 256) - held)
        assert e._prefix_bytes(192) == pytest.approx(sum(p.nbytes for p in src.pages()), abs=1)  # pages only
        release_snapshot(e.pool, states)
        src.free()
        dst.free()


def test_shared_prefix_is_computed_once_and_changes_nothing(model):
    ps = prompts(4, length=40, shared=192)
    with_prefix, m = run(model, ps)
    without, m0 = run(model, ps, prefix_cache=False)
    assert with_prefix == without
    assert m["prefix_hits"] >= 3 and m["prefix_tokens_reused"] >= 3 * 192
    assert m["computed_prompt_tokens"] == m0["computed_prompt_tokens"] - m["prefix_tokens_reused"]


def test_shared_pages_are_referenced_not_copied(model):
    ps = prompts(3, length=10, shared=256)
    with Engine(model, None, EngineConfig(kv="int4", chunk_tokens=64, step_tokens=128)) as e:
        first = e.submit(ps[0], SamplingParams(max_tokens=1, temperature=0))
        while not first.done.is_set():
            e.step()
        rest = [e.submit(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in ps[1:]]
        for _ in range(3):
            e.step()
        assert all(r.cached_tokens == 256 for r in rest)
        a, b = (r.cache.layers[0].pages for r in rest)
        assert a[0] is b[0] and a[0].refs >= 3  # both requests and the snapshot hold one page
        held = sum(p.nbytes for r in rest for p in r.cache.pages())
        assert e.pool.device_bytes < held  # counted once in the pool, however many hold it


def test_prefix_survives_a_restart_on_the_disk_tier(model, tmp_path):
    ps = prompts(1, length=30, shared=128)
    out1, m1 = run(model, ps, offload=f"disk:{tmp_path}")
    out2, m2 = run(model, ps, offload=f"disk:{tmp_path}")
    assert out1 == out2
    assert m1["prefix_tier_hits"] == 0 and m2["prefix_tier_hits"] == 1
    assert m2["computed_prompt_tokens"] == m1["computed_prompt_tokens"] - 128


def test_abort_frees_the_requests_pages(model):
    with Engine(model, None, EngineConfig(kv="int4", chunk_tokens=64, prefix_cache=False)) as e:
        r = e.submit(prompts(1, length=300)[0], SamplingParams(max_tokens=50, temperature=0,
                                                               ignore_eos=True))
        events = []
        r.listener = events.append
        for _ in range(6):
            e.step()
        assert e.pool.pages > 0
        e.abort(r.id)
        e.step()
        assert r.finish_reason == "abort" and r.done.is_set() and events[-1].finished
        assert e.pool.pages == 0 and e.pool.device_bytes == 0 and e.device_bytes() == 0


def test_seeded_sampling_is_reproducible(model):
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a, _ = run(model, prompts(2), params=sp)
    b, _ = run(model, prompts(2), params=sp)
    assert a == b


def test_background_thread_and_listener(model):
    with Engine(model, None, EngineConfig(kv="int4")) as e:
        e.start()
        events = []
        r = e.submit(prompts(1)[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                     listener=events.append)
        assert r.done.wait(30)
        assert [ev.token_id for ev in events] == r.output_ids
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert r.stats["ttft_s"] > 0 and r.stats["output_tokens"] == 5


@pytest.mark.parametrize("cfg, match", [
    (dict(kv="int5"), "unknown KV preset"),
    (dict(kv_budget="lots"), "kv_budget"),
    (dict(kv_budget=0), "kv_budget"),
    (dict(chunk_tokens=100, kv="int4"), "multiple of the KV config's block_size"),
    (dict(step_tokens=8), "step_tokens"),
    (dict(chunk_tokens=512, step_tokens=512), r"chunk_tokens \+ max_running = 512 \+ 64 = 576"),
    (dict(preempt="swap"), "needs a lower tier"),
    (dict(preempt="later"), "preempt"),
    (dict(offload="device@1GiB"), "device is the KV budget"),
    (dict(max_running=0), "max_running"),
])
def test_bad_engine_config_is_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**cfg).check()


def test_a_prompt_is_prefilled_while_others_decode_whatever_the_chunk(model):
    """A step takes a decode token of each running request first, then whole prompt chunks
    while ``step_tokens`` allows: unset, it leaves room for a chunk beside every decode token
    (it had stayed 512 with 512-token chunks, and a new prompt waited until nothing decoded)."""
    assert EngineConfig(chunk_tokens=256).check().step_tokens == 512
    assert EngineConfig().check().chunk_tokens == 512 and EngineConfig().check().step_tokens == 512 + 64
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, 256, (600,), generator=g).tolist()
    with Engine(model, None, EngineConfig(kv="int4", chunk_tokens=512, max_running=2)) as e:
        a = e.submit(long[:40], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        e.step()
        e.step()
        b = e.submit(long, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        before = len(a.output_ids)
        e.step()
        assert b.n_cached == 512 and len(a.output_ids) == before + 1  # both in one step


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(top_p=0), "top_p"),
    ([1, 2], SamplingParams(stop=[""]), "stop"),
    ([1, 999], SamplingParams(), "0..271"),
    ([1] * 4000, SamplingParams(max_tokens=200), "4200 tokens.*4096"),
])
def test_bad_request_is_refused_before_queueing(model, prompt, params, match):
    with Engine(model, None, EngineConfig(kv="int4")) as e:
        with pytest.raises(ValueError, match=match):
            e.submit(prompt, params)
        assert e.metrics()["waiting"] == 0


def test_sliding_window_models_are_refused_by_name():
    m = tiny_random("mistral")
    m.config.sliding_window = 16
    with pytest.raises(ValueError, match="full-attention"):
        Engine(m, None, EngineConfig(kv="int4"))


def test_two_engines_sharing_redis_reuse_each_others_prefix(model, redis_server):
    ps = prompts(2, length=30, shared=128)
    # engine A (one process's server) computes the shared prompt; engine B, a second server
    # behind the same Redis, starts from A's snapshot
    out_a, m_a = run(model, ps[:1], offload=redis_server.url)
    out_b, m_b = run(model, ps[1:], offload=redis_server.url)
    assert m_a["prefix_tier_hits"] == 0 and m_b["prefix_tier_hits"] == 1
    assert m_b["computed_prompt_tokens"] == len(ps[1]) - 128
    assert out_b == run(model, ps[1:])[0]  # the same tokens as computing the prefix itself


def test_redis_gone_degrades_to_recompute_with_one_warning(model, dead_redis_url):
    ps = prompts(2, length=30, shared=128)
    with pytest.warns(RuntimeWarning) as caught:
        out, m = run(model, ps, offload=dead_redis_url)
    assert out == run(model, ps)[0]
    assert m["requests_finished"] == 2
    assert sum("prefix cache" in str(w.message) for w in caught) <= 1


def test_serve_options_reach_the_engine_config():
    """``lessmem serve --step-tokens`` (and the chunk) land in the EngineConfig; left out, the
    engine's own default."""
    from lessmem.cli import build_parser
    from lessmem.serve.cli import engine_config

    p = build_parser("serve")
    cfg = engine_config(p.parse_args(["serve", "--chunk-tokens", "128", "--step-tokens", "1024"]))
    assert (cfg.chunk_tokens, cfg.step_tokens) == (128, 1024)
    default = engine_config(p.parse_args(["serve"])).check()
    assert (default.chunk_tokens, default.step_tokens) == (512, 512 + 64)
    assert engine_config(p.parse_args(["serve", "--chunk-tokens", "256"])).check().step_tokens == 512
