"""Conversion between a :class:`~lessmem.kvcache.KVCache` (history in memory) and a
:class:`~lessmem.kvcache.tiered.TieredKVCache` (history in blocks over tiers): the same
state, bit for bit, either way."""

from __future__ import annotations

import copy

import torch

from ..cache import KVCache
from ..layer import QuantizedKVLayer
from .blocks import join_parts
from .layer import TieredKVLayer
from .staging import ready


def _probe(layer) -> torch.Tensor:
    """An empty key tensor shaped like ``layer``'s (batch, heads, 0 tokens, head_dim)."""
    return torch.empty(layer.batch_size, layer.num_heads, 0, layer.head_dim, dtype=layer.dtype,
                       device=layer.device)


def fill_from(new, src: KVCache) -> None:
    """Copy ``src``'s state into the fresh tiered cache ``new``: sinks and windows as they
    are, the quantized history cut into blocks (layers that are not tiered: deep copies)."""
    feeds = []
    for i, s in enumerate(src.layers):
        d = new.layers[i]
        if not isinstance(d, TieredKVLayer) or not isinstance(s, QuantizedKVLayer):
            new.layers[i] = copy.deepcopy(s)
            continue
        if not s.is_initialized:
            continue
        d.start_like(_probe(s))
        if not s.quantized:
            d.keys, d.values, d.length = s.keys.clone(), s.values.clone(), s.length
            continue
        d.load(length=s.length, sinks=(s.sinks[0].clone(), s.sinks[1].clone()),
               window=(s.window[0].clone(), s.window[1].clone()))
        history = s.history  # (the pieces joined: one copy)
        if history is not None:
            feeds.append((d, history, s.n_history))
    new.refresh_layers()
    # position-major, so that the device tier's LRU order is the age of the tokens
    block_tokens = new.block_tokens
    for t0 in range(0, max((n for _, _, n in feeds), default=0), block_tokens):
        for layer, history, n in feeds:
            if t0 < n:
                layer.append_quantized(history, t0, min(n, t0 + block_tokens))


def in_memory_copy(cache) -> KVCache:
    """An in-memory :class:`KVCache` holding ``cache``'s state (every block gathered)."""
    out = KVCache(cache.model_config, cache.kv_config, attention=cache.attention)
    for i, d in enumerate(cache.layers):
        s = out.layers[i]
        if not isinstance(d, TieredKVLayer) or not d.is_initialized:
            continue
        probe = _probe(d)
        s.lazy_initialization(probe, probe)
        s.length = d.length
        if not d.quantized:
            s.keys, s.values = d.keys.clone(), d.values.clone()
            continue
        s.sinks = (d.sinks[0].clone(), d.sinks[1].clone())
        s.window = (d.window[0].clone(), d.window[1].clone())
        parts = ready(cache.reader.gather(d, list(d.block_keys), d.pending))
        s.history = join_parts(parts) if parts else None
        s.n_history = d.n_history
    return out
