"""Keys stored at each channel's own bits (``KVTensorConfig.channel_bits``): the layout,
the config, the encoder, the kernels against the reference, calibration and the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from lessmem.eval.channels import BITS, allocate_layer, calibrate_channels
from lessmem.formats import PerGroup, PerToken
from lessmem.formats.kvlayout import KVLayout
from lessmem.kernels.attention import QuantKV, QuantSide, quantized_attention
from lessmem.kernels.attention_reference import attention_reference, unpack_codes
from lessmem.kvcache import PRESETS, KVCache, KVConfig, KVTensorConfig, enable
from lessmem.kvcache.cache import cache_kwarg
from lessmem.kvcache.codec import encode, kv_layout
from lessmem.models import tiny_random

CB = (4,) * 8 + (3,) * 16 + (2,) * 24 + (0,) * 16  # 2 bits a channel on average, four runs


def _spec(cb=CB, tg=32, order=()):
    return KVTensorConfig("uint", max(cb), PerGroup(tg, axis=-2), channel_bits=cb, channel_order=order)


@pytest.mark.parametrize("cb", [CB, (8,) * 8 + (5,) * 8 + (1,) * 40 + (0,) * 8, (3,) * 64, (6,) * 8 + (2,) * 56])
def test_mixed_rows_pack_and_unpack_as_the_reference_reads_them(cb):
    lay = KVLayout(bits=max(cb), head_dim=64, channel_group=1, token_group=32, has_zero_point=True,
                   channel_bits=cb)
    g = torch.Generator().manual_seed(0)
    u = torch.stack([torch.randint(0, 2**b, (2, 3, 5), generator=g) for b in cb], -1)
    codes = lay.pack(u)
    assert codes.shape[-1] == lay.row_bytes == sum(cb) // 8
    assert torch.equal(lay.unpack(codes), u) and torch.equal(unpack_codes(codes, lay), u)
    assert lay.mean_bits == sum(cb) / 64


@pytest.mark.parametrize("cb, why", [
    ((2,) * 32 + (3,) * 32, "rise"),
    ((8,) * 8 + (6,) * 8 + (4,) * 8 + (2,) * 8 + (0,) * 32, "at most 4"),
    ((3,) * 4 + (2,) * 60, "multiple of 8"),
    ((2,) * 32, "one per channel"),
])
def test_bad_channel_bits_are_refused_by_the_layout(cb, why):
    with pytest.raises(ValueError, match=why):
        KVLayout(bits=max(cb), head_dim=64, channel_group=1, token_group=32, has_zero_point=True,
                 channel_bits=cb)


def test_config_counts_mean_bits_round_trips_and_reads_older_files():
    spec = _spec(order=tuple(reversed(range(64))))
    assert spec.code_bits == 2.0 and spec.effective_bits(64) == pytest.approx(2.0 + 24 / 32)
    assert KVTensorConfig.from_dict(spec.to_dict()) == spec
    old = KVTensorConfig("uint", 4, PerToken()).to_dict()
    assert "channel_bits" not in old and KVTensorConfig.from_dict(old).channel_bits == ()
    cfg = KVConfig(keys=spec, values=KVTensorConfig("uint", 2), block_size=64)
    assert KVConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("kwargs, why", [
    (dict(format="int", bits=4, granularity=PerGroup(32, axis=-2), channel_bits=CB), "format 'uint' per channel"),
    (dict(format="uint", bits=4, granularity=PerToken(), channel_bits=CB), "format 'uint' per channel"),
    (dict(format="uint", bits=8, granularity=PerGroup(32, axis=-2), channel_bits=CB), "their largest, 4"),
    (dict(format="uint", bits=4, granularity=PerGroup(32, axis=-2), channel_bits=CB, channel_order=(0, 0)),
     "a permutation"),
    (dict(format="uint", bits=4, granularity=PerGroup(32, axis=-2), channel_order=(1, 0)), "without channel_bits"),
    (dict(format="uint", bits=4, granularity=PerGroup(32, axis=-2), channel_bits="4444"), "a tuple or list"),
])
def test_bad_channel_configs_are_refused(kwargs, why):
    with pytest.raises(ValueError, match=why):
        KVTensorConfig(**kwargs)


def test_channel_bits_refuse_key_rotation_and_values():
    with pytest.raises(ValueError, match="rotate_keys=False"):
        KVConfig(keys=_spec(), rotate_keys=True, block_size=32)
    with pytest.raises(ValueError, match="on the keys only"):
        KVConfig(values=_spec(), block_size=32)


def test_encoder_spends_each_channels_bits_and_keeps_zero_bit_channels_at_their_mean():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 64, generator=g) + torch.linspace(-3, 3, 64)
    spec = _spec()
    enc = encode(x, spec)
    y = kv_layout(spec, 64).dequantize(enc.codes, enc.scale, enc.zero_point)
    err = (y - x).pow(2).mean((0, 1, 2))
    means = x.view(1, 2, 2, 32, 64).mean(3, keepdim=True).expand(1, 2, 2, 32, 64).reshape(1, 2, 64, 64)
    assert torch.allclose(y[..., 48:], means[..., 48:], atol=3e-3)  # fp16 of the group mean
    runs = [err[:8].mean(), err[8:24].mean(), err[24:48].mean(), err[48:].mean()]
    assert all(a < b for a, b in zip(runs, runs[1:], strict=False)), runs


@pytest.mark.parametrize("cb", [CB, (8,) * 8 + (4,) * 16 + (2,) * 32 + (0,) * 8, (2,) * 32 + (1,) * 32,
                                (7,) * 8 + (6,) * 8 + (5,) * 8 + (0,) * 40])
def test_fused_kernel_and_torch_path_read_mixed_rows_like_the_reference(cb):
    g = torch.Generator().manual_seed(2)
    spec, vspec = _spec(cb), KVTensorConfig("uint", 4)
    k = encode(torch.randn(1, 3, 192, 64, generator=g) + torch.linspace(-3, 3, 64), spec)
    v = encode(torch.randn(1, 3, 192, 64, generator=g), vspec)
    kv = QuantKV(QuantSide(k.codes, k.scale, k.zero_point, kv_layout(spec, 64)),
                 QuantSide(v.codes, v.scale, v.zero_point, kv_layout(vspec, 64)))
    q = torch.randn(1, 9, 2, 64, generator=g) * 0.2
    ref_o, ref_lse = attention_reference(q, kv)
    for use_cpp in (None, False):
        o, lse = quantized_attention(q, kv, use_cpp=use_cpp)
        assert (o - ref_o).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5


def test_per_head_permutation_matches_its_matrices_for_kv_and_query_heads():
    from lessmem.formats.permutation import channel_permutation

    g = torch.Generator().manual_seed(4)
    orders = torch.stack([torch.randperm(8, generator=g) for _ in range(2)]).flatten().tolist()
    p = channel_permutation(tuple(orders), 8)
    assert p.per_head and p.heads == 2
    for heads in (2, 6):  # KV heads, and query heads three to a KV head
        x = torch.randn(1, heads, 5, 8, generator=g)
        y = p.rotate(x)
        assert torch.equal(y, x @ p.transposed(heads)) and torch.equal(p.inverse(y), x)
        kv = heads // 2 if heads > 2 else 1
        for h in range(heads):
            assert torch.equal(y[0, h], x[0, h][:, orders[8 * (h // kv):8 * (h // kv) + 8]])
    with pytest.raises(ValueError, match="multiple"):
        p.rotate(torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match="one such permutation per KV head"):
        _spec(order=tuple(range(64)) + (0,) * 64)


def test_allocation_spends_bits_where_the_score_error_is_and_keeps_rows_whole():
    D = 64
    weight = torch.logspace(2, -3, D, dtype=torch.float64)  # E[q²]·var(k) falling over channels
    b = torch.tensor(BITS, dtype=torch.float64)
    cost = weight[:, None] * 4.0 ** -b[None, :]  # error of a channel at each candidate width
    cb, order = allocate_layer(cost, 2.0)
    assert sum(cb) <= 2 * D and len(set(cb)) <= 4 and sorted(order) == list(range(D))
    KVLayout(bits=max(cb), head_dim=D, channel_group=1, token_group=32, has_zero_point=True, channel_bits=cb)
    bits = torch.zeros(D, dtype=torch.long)
    bits[list(order)] = torch.tensor(cb)
    assert bits[0] > bits[D // 2] >= bits[-1]
    got = float(cost[torch.arange(D), torch.tensor([BITS.index(int(x)) for x in bits])].sum())
    assert got < 0.5 * float(cost[:, BITS.index(2)].sum())  # uniform 2 bits: at least twice the error


def _run(model, cache, ids, prefill):
    out = []
    with torch.no_grad():
        for s, e in ((0, prefill), *[(i, i + 1) for i in range(prefill, ids.shape[1])]):
            out.append(model(input_ids=ids[:, s:e], **{cache_kwarg(model): cache}, use_cache=True).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("per_head", [True, False])
def test_calibrated_cache_tracks_dynamic_and_fused_equals_dequantized(per_head):
    model = tiny_random("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2)
    gen = torch.Generator().manual_seed(3)
    cfg = calibrate_channels(model, torch.randint(3, 270, (2, 128), generator=gen), 2.0,
                             PRESETS["best-2"].replace(window=16), token_group=32, per_head=per_head)
    assert cfg.rotate_keys is False and len(cfg.layer_overrides) == 2
    heads = 2 if per_head else 1
    for _, k, _v in cfg.layer_overrides:
        assert k.code_bits <= 2.0 and len(k.channel_order) == 32 * heads
        assert all(sorted(k.channel_order[i:i + 32]) == list(range(32)) for i in range(0, 32 * heads, 32))
    if per_head:
        assert any(k.channel_order[:32] != k.channel_order[32:] for _, k, _v in cfg.layer_overrides)
    ids = torch.randint(3, 270, (1, 120), generator=gen)
    ref = _run(model, DynamicCache(config=model.config), ids, 100)
    got = _run(model, KVCache(model.config, cfg), ids, 100)
    with enable(model):
        fused = _run(model, KVCache(model.config, cfg), ids, 100)
    lp, lr = got[:, 100:].log_softmax(-1), ref[:, 100:].log_softmax(-1)
    kld = (lr.exp() * (lr - lp)).sum(-1).mean().item()
    assert 1e-7 < kld < 0.3, kld
    scale = got.abs().max().item()
    assert (fused - got).abs().max().item() < 2e-3 * scale


def test_committed_channel_configs_plan_what_the_cache_holds():
    from lessmem.kvcache.presets import load_config
    from lessmem.plan.planner import plan

    path = Path(__file__).parents[2] / "benchmarks/results/kv_configs/chan-2.5.json"
    cfg = load_config(path)
    assert all(k.channel_bits for _, k, _v in cfg.layer_overrides)
    from test_memory_and_blocks import _fill, _smollm_config

    cache = KVCache(_smollm_config(), cfg, attention="fused")
    _fill(cache, 4096, 30)
    mem = cache.memory()
    row = plan("smollm2-135m", context=4096, kv=[str(path)])["kv"][0]
    assert abs(row["total"] - mem["total"]) <= 0.02 * mem["total"]


def test_tiered_cache_with_channel_bits_is_bit_exact_with_the_in_memory_cache(tmp_path):
    """Blocks of mixed rows, with their own orders per head, through a host and a disk tier."""
    import _gen

    from lessmem.kvcache.tiered import TieredKVCache

    m = _gen.model()  # tiny llama: 2 KV heads of 16 channels, 4 layers
    keys = KVTensorConfig("uint", 4, PerGroup(16, axis=-2), channel_bits=(4,) * 8 + (0,) * 8,
                          channel_order=(*range(16), *reversed(range(16))))
    cfg = _gen.CFG.replace(layer_overrides=tuple((i, keys, KVTensorConfig("uint", 2)) for i in range(4)))
    ids = _gen.prompt()
    with enable(m):
        ref = KVCache(m.config, cfg)
        ref_toks, ref_logits = _gen.decode(m, ref, _gen.chunked_prefill(m, ref, ids), 20)
        cache = TieredKVCache(m.config, cfg, tiers=f"host@6KiB,disk:{tmp_path}", block_tokens=16,
                              device_budget="24KiB")
        toks, logits = _gen.decode(m, cache, _gen.chunked_prefill(m, cache, ids), 20)
    assert toks == ref_toks and all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    place = cache.memory()["tiers"]
    assert place["host"] > 0 and place["disk"] > 0


def test_cuda_backend_sends_mixed_rows_to_the_torch_path():
    """The Triton kernel does not read mixed rows: the op's CUDA backend answers them with torch
    ops on the tensors' device (called here on CPU tensors: the same code)."""
    from lessmem.kernels import attention, ops

    g = torch.Generator().manual_seed(5)
    spec, vspec = _spec(), KVTensorConfig("uint", 4)
    k = encode(torch.randn(1, 3, 64, 64, generator=g), spec)
    v = encode(torch.randn(1, 3, 64, 64, generator=g), vspec)
    kv = QuantKV(QuantSide(k.codes, k.scale, k.zero_point, kv_layout(spec, 64)),
                 QuantSide(v.codes, v.scale, v.zero_point, kv_layout(vspec, 64)))
    q = torch.randn(1, 9, 1, 64, generator=g) * 0.2
    args = ops.op_args(q, kv, None)
    o, lse = attention._cuda_backend(*args)
    ref_o, ref_lse = attention_reference(q, kv)
    assert (o - ref_o).abs().max() < 1e-5 and (lse - ref_lse).abs().max() < 1e-5


def test_a_channel_config_for_another_model_is_refused_when_the_cache_is_built():
    from transformers import LlamaConfig

    from lessmem.kvcache.presets import load_config

    cfg = load_config(Path(__file__).parents[2] / "benchmarks/results/kv_configs/chan-2.5.json")
    other = LlamaConfig(num_hidden_layers=30, hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=100)  # head_dim 128
    with pytest.raises(ValueError, match="layer 0: keys with 64 channel bits.*another model"):
        KVCache(other, cfg)
    fewer_heads = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=1,
                              intermediate_size=64, vocab_size=100)  # 1 KV head: 3 orders do not fit
    with pytest.raises(ValueError, match="1 x 64 entries"):
        KVCache(fewer_heads, cfg)
