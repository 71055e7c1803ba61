"""Honest memory accounting (tensors held vs the planner), append-only blocks."""

from __future__ import annotations

import pytest
import torch
from kvhelpers import left_padded_ids, run_chunks
from transformers import LlamaConfig

from lessmem.kvcache import PRESETS, KVCache
from lessmem.kvcache.block import KVBlock
from lessmem.offload.serialize import pack_block, unpack_block
from lessmem.plan.kv import kv_bytes


def _fill(cache, n_tokens, layers, kv_heads=3, head_dim=64, chunks=(1000, 1, 7)):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 1, kv_heads, n_tokens, head_dim, generator=g)
    sizes = [c for c in chunks if c and c < n_tokens // 2]
    sizes.append(n_tokens - sum(sizes))
    s = 0
    for n in sizes:
        for i in range(layers):
            cache.update(kv[0, :, :, s:s + n], kv[1, :, :, s:s + n], i)
        s += n


def _smollm_config():
    return LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)


class _Dims:
    layers, kv_heads, head_dim = 30, 3, 64


_FILLED: dict = {}


def _filled(preset):
    """A smollm2-shaped cache holding 4096 tokens (built once per preset)."""
    if preset not in _FILLED:
        cache = KVCache(_smollm_config(), preset, attention="fused")  # update() returns views
        _fill(cache, 4096, 30)
        _FILLED[preset] = cache
    return _FILLED[preset]


@pytest.mark.parametrize("preset", ["best-4", "kivi-2", "int8", "best-2", "best-3"])
def test_planner_matches_measured_bytes_smollm2(preset):
    mem = _filled(preset).memory()
    plan = kv_bytes(_Dims(), 4096, 1, PRESETS[preset].to_plan(preset))
    assert abs(plan["total"] - mem["total"]) <= 0.02 * mem["total"]
    assert mem["fp16_equivalent"] == plan["fp16"]


def test_planner_matches_measured_bytes_of_a_per_layer_config():
    """``lessmem plan --kv FILE.json``: a per-layer allocation (bits differ by layer) is
    planned by its mean bits over the model's layers; the bytes equal what the cache holds."""
    from pathlib import Path

    from lessmem.kvcache.presets import load_config
    from lessmem.plan.planner import plan

    path = Path(__file__).parents[2] / "benchmarks/results/kv_configs/mixed-3.0.json"
    cache = KVCache(_smollm_config(), load_config(path), attention="fused")
    _fill(cache, 4096, 30)
    mem = cache.memory()
    row = plan("smollm2-135m", context=4096, kv=[str(path)])["kv"][0]
    assert row["precision"] == "mixed-3.0"
    assert abs(row["total"] - mem["total"]) <= 0.02 * mem["total"]
    assert row["fp16"] == mem["fp16_equivalent"]


def test_memory_is_summed_from_tensors_and_bits_match_config():
    cache = _filled("best-4")
    mem = cache.memory()
    held = 0
    for layer in cache.layers:
        held += sum(t.numel() * t.element_size() for t in (*layer.sinks, *layer.window))
        held += sum(t.numel() * t.element_size() for t in layer.history.values())
    assert mem["total"] == held
    assert mem["total"] == sum(mem[k] for k in ("codes", "scales", "zero_points", "window", "sinks"))
    kb, vb = PRESETS["best-4"].effective_bits(64)
    assert mem["k_bits"] == pytest.approx(kb) and mem["v_bits"] == pytest.approx(vb)
    assert mem["k_bits"] <= 4.6 and mem["compression"] >= 3.3
    assert mem["fp16_equivalent"] == 4096 * 30 * 3 * 64 * 2 * 2


def test_fp16_preset_holds_model_dtype():
    cache = KVCache(_smollm_config(), "fp16", attention="fused")
    _fill(cache, 200, 30)
    mem = cache.memory()
    assert mem["codes"] == 0 and mem["window"] == 200 * 30 * 3 * 64 * 2 * 4  # fp32 inputs
    assert mem["fp16_equivalent"] == mem["window"] // 2


def test_blocks_are_append_only(llama):
    ids, _ = left_padded_ids(1, 400, [0], seed=8)
    cfg = PRESETS["kivi-2"].replace(window=16)
    cache = KVCache(llama.config, cfg)
    run_chunks(llama, ids[:, :150], cache, [100, 1, 1])
    layer = cache.layers[1]
    first = [{k: v.clone() for k, v in b.tensors().items()} for b in layer.blocks()]
    assert len(first) == (150 - 16) // 32
    run_chunks(llama, ids[:, 150:], cache, [1, 5, 100])
    later = layer.blocks()
    assert len(later) > len(first)
    for old, new in zip(first, later[: len(first)], strict=True):
        assert old.keys() == new.tensors().keys()
        assert all(torch.equal(old[k], new.tensors()[k]) for k in old)
    starts = [b.start for b in later]
    assert starts == [cfg.sinks + 32 * i for i in range(len(later))]


def test_block_bytes_round_trip(llama):
    ids, _ = left_padded_ids(1, 120, [0], seed=9)
    cache = KVCache(llama.config, PRESETS["best-4"].replace(window=16))
    run_chunks(llama, ids, cache, [120])
    (block,) = cache.layers[0].blocks()
    # a block's parts in the offload tiers' checksummed format (what a disk/remote tier stores)
    blob = pack_block(block.tensors(), meta={"start": block.start, "n_tokens": block.n_tokens})
    tensors, meta = unpack_block(blob)
    again = KVBlock(int(meta["start"]), int(meta["n_tokens"]), tensors)
    assert again.start == block.start == 4 and again.n_tokens == 64
    assert again.nbytes == block.nbytes > 0
    assert all(torch.equal(again.tensors()[k], v) for k, v in block.tensors().items())
    blob = bytearray(blob)  # a flipped byte is caught
    blob[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        unpack_block(bytes(blob))
