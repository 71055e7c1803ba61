"""Helpers for the KV-cache tests: tiny random models and chunked forwards."""

from __future__ import annotations

import torch

from lessmem.kvcache.cache import cache_kwarg
from lessmem.models import tiny_random


def tiny(arch: str = "llama", sliding_window=None, num_layers: int = 2):
    # head_dim 64 (4 query heads, 2 KV heads: GQA) so every preset's groups fit
    m = tiny_random(arch, num_layers=num_layers, hidden_size=256, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, sliding_window=sliding_window)
    return m.eval()


def left_padded_ids(batch: int, length: int, pads: list[int], seed: int = 0, vocab: int = 250):
    """(ids [B, T], attention_mask [B, T]) with row b left-padded by pads[b] tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads):
        ids[b, :p] = 0
        mask[b, :p] = 0
    return ids, mask


def run_chunks(model, ids, cache, chunks, mask=None):
    """Feed ``ids`` through ``cache`` in chunks (sizes ``chunks``, rest in one piece);
    returns the logits of every position [B, T, V]. Positions follow the padding mask."""
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    sizes = list(chunks)
    if sum(sizes) < T:
        sizes.append(T - sum(sizes))
    out, s = [], 0
    with torch.no_grad():
        for n in sizes:
            e = s + n
            r = model(input_ids=ids[:, s:e], attention_mask=mask[:, :e], position_ids=pos[:, s:e],
                      **{cache_kwarg(model): cache}, use_cache=True)
            out.append(r.logits)
            s = e
    return torch.cat(out, dim=1)
