"""Bits per key channel from calibration: keys stored at each channel's own precision.

A key channel's quantization error reaches the attention scores through the queries:
``q·k̂ − q·k = Σ_c q_c δ_c``, so with errors independent across channels the score error
is ``Σ_c E[q_c²] · E[δ_c²]``. Channels differ widely in both factors (RoPE pairs of low
frequency carry large, slowly varying keys; many channels meet queries that are nearly
zero), so the same bits everywhere waste most of them. Giving each channel the bits
that minimise that weighted sum under a budget is classical bit allocation for transform
coding (reverse water-filling; Gersho & Gray, *Vector Quantization and Signal
Compression*, 1992, ch. 8); KVQuant (Hooper et al., NeurIPS 2024, arXiv:2401.18079)
showed that keys must be quantized per channel, and this spends the bits per channel too.
On the built-in model, through the evaluation protocol, the ≤ 2.5-bit cache goes from
+9.2% perplexity (uniform rotated keys, ``bench_kv_quality_mixed.json``) to +2.3%
(``benchmarks/results/bench_kv_quality_channels.json``).

:func:`calibrate_channels` runs the model on calibration text, records for every layer
and channel ``E[q_c²]`` (summed over the query heads sharing a KV head) and the mean
squared error of the channel's keys quantized at each candidate bit width (the cache's
own quantizer: per-channel groups of ``token_group`` tokens, the range holding zero, a
0-bit channel kept as its group's mean), then chooses each layer's bits by a Lagrangian
search over at most four bit widths (``MAX_RUNS``) (the stored row holds at most four runs of equal
bits, each a multiple of 8 channels). Each KV head ranks its channels by their cost; the
bits are chosen per rank (one pattern for the layer: the stored row has one layout) and
each head stores its channels sorted by their bits (``channel_order``, one order per
head; the queries are reordered alike, so scores are unchanged).

Example (a tiny random model: the shapes, not the numbers, mean something):
    >>> import torch
    >>> from lessmem.models import tiny_random
    >>> from lessmem.kvcache import PRESETS
    >>> model = tiny_random("llama", num_layers=2, hidden_size=128, num_heads=4)
    >>> ids = torch.randint(0, model.config.vocab_size, (2, 256))
    >>> cfg = calibrate_channels(model, ids, key_bits=2.0, template=PRESETS["best-3"])
    >>> k = cfg.for_layer(0)[0]
    >>> len(k.channel_bits), sum(k.channel_bits) <= 2 * 32, len(k.channel_order)  # an order per KV head
    (32, True, 64)
    >>> sorted(k.channel_order[:32]) == sorted(k.channel_order[32:]) == list(range(32))
    True
"""

from __future__ import annotations

import itertools

import torch

from ..formats.granularity import PerGroup
from ..formats.integer import choose_qparams, dequantize_grouped, quantize_grouped
from ..formats.kvlayout import MAX_RUNS
from ..kvcache.config import KVConfig, KVTensorConfig

CAPTURE = "lessmem-capture"
#: candidate bits of one channel (a row holds at most four of them: MAX_RUNS)
BITS = (0, 1, 2, 3, 4, 5, 6, 8)


def _group_mse(k: torch.Tensor, bits: int, tg: int) -> torch.Tensor:
    """Per-channel mean squared error [H, D] of keys ``k [H, T, D]`` through the cache's own
    affine quantizer (per-channel groups of ``tg`` tokens, range holding zero; float32
    scales); 0 bits: the group mean."""
    H, T, D = k.shape
    n = T // tg * tg
    g = k[:, :n].reshape(H, n // tg, tg, D).float()
    if bits == 0:
        return (g - g.mean(2, keepdim=True)).pow(2).mean((1, 2))
    xg = g.transpose(2, 3).reshape(-1, tg)  # a row: one channel's tg tokens
    scale, zp = choose_qparams(xg, bits, False, scale_dtype=torch.float32)
    y = dequantize_grouped(quantize_grouped(xg, scale, zp, bits), scale, zp, bits)
    return (y - xg).pow(2).view(H, n // tg, D, tg).transpose(2, 3).mean((1, 2))


class _Stats:
    """Per layer: E[q_c²] per KV head [Hkv, D] and the key MSE [Hkv, D, len(BITS)]."""

    def __init__(self, tg: int):
        self.tg, self.q2, self.err = tg, {}, {}

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        if T < self.tg:
            return
        q2 = q.float().pow(2).mean(2).view(B, Hkv, Hq // Hkv, D).sum(2).sum(0)  # [Hkv, D]
        err = torch.stack([torch.stack([_group_mse(k[b], bits, self.tg) for bits in BITS], -1)
                           for b in range(B)]).sum(0)  # [Hkv, D, nbits]
        for store, v in ((self.q2, q2), (self.err, err)):
            store[layer] = store.get(layer, 0) + v


def _capture_attention(stats: _Stats):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        stats.add(int(module.layer_idx), query.detach(), key.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return attend


def _lagrange(cost: torch.Tensor, levels: tuple[int, ...], budget: float) -> torch.Tensor:
    """Bits per channel from ``levels`` minimising Σ cost under Σ bits <= budget."""
    idx = torch.tensor([BITS.index(b) for b in levels])
    c = cost[:, idx]  # [D, L]
    lv = torch.tensor(levels, dtype=torch.float64)
    lo, hi, best = 0.0, float(c.max()) * 64 + 1.0, None
    for _ in range(60):
        lam = (lo + hi) / 2
        pick = (c + lam * lv).argmin(1)
        if lv[pick].sum() <= budget:
            best, hi = pick, lam
        else:
            lo = lam
    if best is None:
        best = torch.zeros(c.shape[0], dtype=torch.long)  # every channel at the lowest level
    return lv[best].long()


def _runs_of_eight(bits: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """Lower the least costly channels of each run until every run is a multiple of 8 (what
    KVLayout's mixed rows hold, so that 8 codes unpack at once; a 0-bit run stores nothing)."""
    bits = bits.clone()
    for b in sorted(set(bits.tolist()), reverse=True):
        if b == 0:
            continue
        members = (bits == b).nonzero().flatten()
        extra = len(members) % 8
        if extra:
            # drop the channels that lose least by going one level down (to the next lower level present)
            lower = max([x for x in set(bits.tolist()) if x < b], default=0)
            loss = cost[members, BITS.index(lower)] - cost[members, BITS.index(b)]
            bits[members[loss.argsort()[:extra]]] = lower
    return bits


def _fill_budget(bits: torch.Tensor, cost: torch.Tensor, levels: tuple[int, ...], budget: float) -> torch.Tensor:
    """Raise 8 channels at a time from one level to a higher one (runs stay multiples of 8)
    while the bits fit ``budget``, the largest cost cut per bit first (what rounding the
    runs down gave back)."""
    bits = bits.clone()
    while True:
        left, best = budget - float(bits.sum()), None
        for lo, hi in itertools.combinations(sorted(levels), 2):
            members = (bits == lo).nonzero().flatten()
            extra = 8 * (hi - lo)
            if len(members) < 8 or extra > left:
                continue
            gain = cost[members, BITS.index(lo)] - cost[members, BITS.index(hi)]
            top = gain.argsort(descending=True)[:8]
            rate = float(gain[top].sum()) / extra
            if rate > 0 and (best is None or rate > best[0]):
                best = (rate, members[top], hi)
        if best is None:
            return bits
        bits[best[1]] = best[2]


def allocate_layer(cost: torch.Tensor, mean_bits: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(channel_bits, channel_order) of one layer from ``cost [D, len(BITS)]`` (the weighted
    score error of each channel at each of ``BITS``) within ``mean_bits`` code bits a channel.

    ``cost [H, D, len(BITS)]`` (one per KV head): each head ranks its channels by their
    cost at 0 bits; the bits are chosen per rank on the heads' summed cost, so each head
    stores its own channels in its own order (``H`` orders one after another)."""
    if cost.dim() == 3:
        # rank r: each head's r-th most costly channel (at 0 bits); the bits are chosen per rank
        ranks = [sorted(range(c.shape[0]), key=lambda i, c=c: (-float(c[i, 0]), i)) for c in cost]
        by_rank = torch.stack([c[r] for c, r in zip(cost, ranks, strict=True)]).sum(0)
        bits, stored = allocate_layer(by_rank, mean_bits)
        return bits, tuple(r[i] for r in ranks for i in stored)
    D = cost.shape[0]
    budget = mean_bits * D
    best = None
    for rest in itertools.combinations(BITS[1:], MAX_RUNS - 1):
        levels = (0, *rest)
        bits = _fill_budget(_runs_of_eight(_lagrange(cost, levels, budget), cost), cost, levels, budget)
        total = float(cost[torch.arange(D), torch.tensor([BITS.index(int(b)) for b in bits])].sum())
        if best is None or total < best[0]:
            best = (total, bits)
    bits = best[1]
    order = sorted(range(D), key=lambda c: (-int(bits[c]), c))
    return tuple(int(bits[c]) for c in order), tuple(order)


def calibrate_channels(model, ids: torch.Tensor, key_bits: float | None, template: KVConfig,
                       token_group: int = 128, per_head: bool = True) -> KVConfig:
    """A KVConfig like ``template`` (values, window, sinks; no key rotation) whose keys in
    every layer get their own bits per channel, ``key_bits`` code bits a channel on average
    (None: each layer the code bits ``template`` gives its keys, e.g. a per-layer
    allocation from :func:`lessmem.eval.allocate.allocate`), measured on
    ``ids [windows, tokens]`` (see the module doc). ``per_head``: each KV head its own
    channel order (the bits of a layer are one pattern for all its heads)."""
    if not isinstance(template, KVConfig):
        raise ValueError(f"template={template!r}; allowed: a KVConfig (a preset: PRESETS[name])")
    if key_bits is not None and (isinstance(key_bits, bool) or not isinstance(key_bits, (int, float))
                                 or not 0.5 <= key_bits <= 8):
        raise ValueError(f"key_bits={key_bits!r}; allowed: a number from 0.5 to 8 (mean code bits a "
                         "channel), or None (the template's bits in each layer)")
    if ids.dim() != 2 or ids.shape[1] < token_group:
        raise ValueError(f"ids of shape {tuple(ids.shape)}; allowed: [windows, tokens] with at least "
                         f"token_group={token_group} tokens")
    from transformers import AttentionInterface

    from ..kvcache.attention import _set

    stats = _Stats(token_group)
    AttentionInterface.register(CAPTURE, _capture_attention(stats))
    previous = model.config._attn_implementation
    _set(model, CAPTURE)
    try:
        with torch.no_grad():
            for w in ids:
                model(w[None].to(model.device), use_cache=False)
    finally:
        _set(model, previous)
    block = max(template.block_size, token_group)
    block = block // token_group * token_group
    overrides = []
    for layer in sorted(stats.q2):
        if layer in template.skip_layers:
            continue
        cost = (stats.q2[layer].unsqueeze(-1) * stats.err[layer]).double()  # [Hkv, D, nbits]
        if not per_head:
            cost = cost.sum(0)
        budget = key_bits if key_bits is not None else template.for_layer(layer)[0].code_bits
        cb, order = allocate_layer(cost, budget)
        keys = KVTensorConfig("uint", max(cb), PerGroup(token_group, axis=-2), channel_bits=cb,
                              channel_order=order)
        overrides.append((layer, keys, template.for_layer(layer)[1]))
    base_keys = KVTensorConfig("uint", 4, PerGroup(token_group, axis=-2))
    return template.replace(keys=base_keys, rotate_keys=False, block_size=block,
                            layer_overrides=tuple(overrides))
