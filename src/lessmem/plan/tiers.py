"""Tier split on paper: where a ``TieredKVCache`` will put a request's KV bytes.

Given a lessmem cache preset, a device budget (``--kv-budget``) and the tiers below it
(``--offload host@1GiB,disk:/path``), :func:`tier_split` replays, in arithmetic only,
the policy of :class:`lessmem.kvcache.tiered.TieredKVCache` over a request fed in
chunks (the prompt in chunks of ``prefill_chunk`` tokens, then ``decode_tokens`` tokens
one at a time) and returns the bytes each tier holds at the end, plus the strings to pass
to ``lessmem generate``/``lessmem eval``.

The policy replayed, per layer ℓ of L, batch B, H KV heads of dimension D:

- the first ``sinks`` tokens and the window (``window`` .. ``window + block - 1`` most
  recent tokens, full precision, ``tb = 2·B·H·D·full_bytes`` bytes per token and layer)
  always stay on the device; tokens leave the window ``block`` at a time, quantized, into
  the layer's *pending* block, which is sealed every ``block_tokens`` tokens into a block
  of ``bb`` bytes (codes + scales + zero points of ``block_tokens`` tokens of one layer);
- resident bytes ``fp`` = Σ_ℓ (sinks + window_capacity(window))·tb + pending bytes (a
  window is held in a buffer of its tokens rounded up to ``WINDOW_GRAIN`` = 16);
- before every read of a layer's history and at every seal the device tier is resized to
  ``room = budget − fp − c·tb·L_init − reserve`` (``c``: tokens in this forward, for the
  layers still to grow; ``reserve``: the largest layer history, twice with prefetch, for
  the gathered histories in flight) and keeps the most recent ``⌊room / bb⌋`` blocks;
  older blocks are demoted (never promoted back) to the first lower tier, whose least
  recently used blocks go one tier further down when it is full. A full last tier loses
  blocks (``lost_blocks``; the cache would raise ``BlockLostError`` reading them).

The arithmetic of that rule (need, room, reserve, blocks kept, the implicit device tier)
is :mod:`lessmem.base.placement`, which the cache's device budget uses too.

Blocks all have the same size, so each tier's share is a block count: the device tier
holds what survived the smallest ``room`` since each block was sealed, the host the most
recently demoted ``⌊capacity / bb⌋``, the next tier the rest. ``needed_budget`` is the
largest ``fp + c·tb·L + reserve`` seen: with less, the device holds more than its budget
(the cache counts such reads in ``over_budget``).

Example:
    >>> from lessmem.plan.kv import get_kv
    >>> from lessmem.plan.models import get_model
    >>> s = tier_split(get_model("smollm2-135m"), get_kv("lessmem:int4"), 4096, kv_budget="16MiB",
    ...                offload="host@8MiB,disk:/tmp/kv")
    >>> [(t["tier"], t["blocks"]) for t in s["tiers"]], s["block_bytes"]
    ([('device', 86), ('host', 156), ('disk', 208)], 53760)
    >>> s["args"]
    '--kv int4 --kv-budget 16MiB --offload host@8MiB,disk:/tmp/kv --block-tokens 256'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..base.placement import (
    blocks_kept,
    check_lower_tiers,
    device_need,
    device_room,
    staging_reserve,
    window_capacity,
)
from ..base.tierspec import TierSpec, format_offload_spec, parse_offload_spec, redact_url, size_text
from ..base.units import parse_bytes
from .kv import KVPrecision, layer_quant_bytes


def quantized_bytes(model, p: KVPrecision, n_tokens: int, batch: int = 1) -> int:
    """Bytes of ``n_tokens`` quantized tokens of one layer (codes, scales, zero points):
    ``B·H·n·D·(k_bits + v_bits)/8`` plus one scale (and zero point) per group per head."""
    codes, meta = layer_quant_bytes(model, p, n_tokens, batch)
    return int(math.ceil(codes + meta)) if n_tokens else 0


@dataclass
class _Layer:
    """One layer's token counts: sinks, window, quantized pending tokens, sealed blocks."""

    sinks: int = 0
    window: int = 0
    pending: int = 0
    blocks: int = 0


def _schedule(context: int, prefill_chunk: int, decode_tokens: int, decode_chunk: int = 1) -> list[int]:
    """Tokens per forward: the prompt in ``prefill_chunk``s, then the rest in ``decode_chunk``s."""
    prompt = context - decode_tokens
    return ([min(prefill_chunk, prompt - a) for a in range(0, prompt, prefill_chunk)]
            + [min(decode_chunk, context - a) for a in range(prompt, context, decode_chunk)])


def _check_int(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r}; allowed: an integer >= {lo}")


def tier_split(model, precision: KVPrecision, context: int, batch: int = 1, kv_budget=None,
               offload: str | list = "host", block_tokens: int = 256, prefetch: bool = True,
               prefill_chunk: int | None = None, decode_tokens: int = 0, kv_name: str | None = None,
               decode_chunk: int = 1) -> dict:
    """Bytes per tier after ``context`` tokens of ``batch`` requests (see the module doc).

    ``model``: a :class:`~lessmem.plan.models.ModelDims` (or anything with ``layers``,
    ``kv_heads``, ``head_dim``); ``precision``: a lessmem cache preset as a KVPrecision
    (``get_kv("kivi-2")``, ``KVConfig.to_plan()``); ``kv_budget``: device bytes (None =
    unbounded: everything stays on the device); ``offload``: the lower tiers as
    ``--offload`` takes them; ``prefill_chunk``: tokens per prefill forward (default
    ``block_tokens``, as ``TieredKVCache.prefill`` feeds; ``lessmem generate`` feeds the
    whole prompt at once); ``decode_tokens``: the last tokens of ``context``, fed
    ``decode_chunk`` at a time (1: decoding; ``lessmem eval`` scores the last three quarters
    of each window in chunks of ``--chunk``); ``kv_name``: the ``--kv`` name for the emitted
    arguments.
    """
    p = precision
    specs, prefill_chunk = _check_split(p, context, batch, offload, block_tokens, prefill_chunk,
                                        decode_tokens, decode_chunk)
    budget = None if kv_budget is None else parse_bytes(kv_budget, "kv_budget")
    dev = _DeviceReplay(budget, quantized_bytes(model, p, block_tokens, batch), prefetch)
    last = _replay(model, p, batch, block_tokens, dev,
                   _schedule(context, prefill_chunk, decode_tokens, decode_chunk))

    L, bb = model.layers, dev.block_bytes
    rows = [{"tier": "device", "target": None, "capacity": budget, "blocks": dev.count,
             "bytes": dev.count * bb}]
    left = dev.demoted
    for s in specs:
        n = left if s.capacity is None else min(left, s.capacity // bb)
        rows.append({"tier": s.kind, "target": redact_url(s.target) if s.kind == "remote" else s.target,
                     "capacity": s.capacity, "blocks": n, "bytes": n * bb})
        left -= n
    resident = int(round(L * last["fp"]))
    name = kv_name or p.name.removeprefix("lessmem:")
    off = format_offload_spec(specs)
    args = f"--kv {name}" + (f" --kv-budget {size_text(budget)}" if budget is not None else "") + \
        f" --offload {off} --block-tokens {block_tokens}" + ("" if prefetch else " --no-prefetch")
    total = last["blocks"] * L
    return {
        "precision": p.name, "context": context, "batch": batch, "block_tokens": block_tokens,
        "block_bytes": bb, "blocks": total, "quantized_bytes": total * bb + L * last["pending_bytes"],
        "resident_bytes": resident, "device_bytes": resident + dev.count * bb,
        "kv_budget": budget, "needed_budget": int(math.ceil(dev.needed)),
        "within_budget": budget is None or dev.needed <= budget,
        "tiers": rows, "lost_blocks": left, "fits": left == 0,
        "prefetch": bool(prefetch), "prefill_chunk": prefill_chunk, "decode_tokens": decode_tokens,
        "decode_chunk": decode_chunk,
        "offload": off, "args": args,
    }


def _check_split(p: KVPrecision, context, batch, offload, block_tokens, prefill_chunk,
                 decode_tokens, decode_chunk) -> tuple[list[TierSpec], int]:
    """Every argument of ``tier_split`` checked before any arithmetic: (tier specs, prefill chunk)."""
    _check_int("context", context, 1)
    _check_int("batch", batch, 1)
    _check_int("decode_tokens", decode_tokens, 0)
    if decode_tokens >= context:
        raise ValueError(f"decode_tokens={decode_tokens}; allowed: fewer than context={context} "
                         "(the prompt needs at least one token)")
    if p.skip_layers:
        raise ValueError(f"KV precision {p.name!r} has skip_layers={p.skip_layers}; the tier split "
                         "models quantized layers only; allowed: skip_layers=0")
    if p.k_bits >= 16 and p.v_bits >= 16:
        raise ValueError(f"KV precision {p.name!r} is not quantized; a tiered cache stores quantized "
                         "blocks; allowed: a quantized lessmem preset such as int4, kivi-2, best-4")
    _check_int("block_tokens", block_tokens, 1)
    if block_tokens % p.block:
        raise ValueError(f"block_tokens={block_tokens}; allowed: a positive multiple of {p.name}'s "
                         f"block size {p.block}")
    prefill_chunk = block_tokens if prefill_chunk is None else prefill_chunk
    _check_int("prefill_chunk", prefill_chunk, 1)
    _check_int("decode_chunk", decode_chunk, 1)
    specs = parse_offload_spec(offload) if isinstance(offload, str) else list(offload)
    if not specs or not all(isinstance(s, TierSpec) for s in specs):
        raise ValueError(f"offload={offload!r}; allowed: an --offload string or a list of TierSpec")
    check_lower_tiers(specs, what="offload", budget_name="kv_budget")
    return specs, prefill_chunk


class _DeviceReplay:
    """The device tier's block count under the cache's own rule (``lessmem.base.placement``),
    replayed in block counts: ``count`` blocks held, ``demoted`` moved down, ``needed`` the
    largest device need seen."""

    def __init__(self, budget: int | None, block_bytes: int, prefetch: bool):
        self.budget, self.block_bytes, self.prefetch = budget, block_bytes, prefetch
        self.count = self.demoted = 0
        self.needed = 0.0

    def rebalance(self, fp_all: float, growth: float, largest_history: int) -> int | None:
        """Shrink the device tier to what the budget leaves; the blocks it may keep (None: all)."""
        need = device_need(fp_all, growth, staging_reserve(largest_history, self.prefetch))
        self.needed = max(self.needed, need)
        cap = blocks_kept(device_room(self.budget, need), self.block_bytes)
        if cap is None:
            return None
        if self.count > cap:
            self.demoted += self.count - cap
            self.count = cap
        return cap

    def seal(self, cap: int | None) -> None:
        """A sealed block goes on the device, or (no room) its LRU block or itself moves down."""
        if cap is None or self.count < cap:
            self.count += 1
        else:
            self.demoted += 1


def _replay(model, p: KVPrecision, batch: int, block_tokens: int, dev: _DeviceReplay,
            schedule: list[int]) -> dict:
    """Feed ``schedule``'s chunks through every layer as the cache does; the last layer state."""
    L = model.layers
    tb = 2 * batch * model.kv_heads * model.head_dim * p.full_bytes  # one full-precision token, one layer
    bb = dev.block_bytes

    def q(n):  # pending bytes
        return quantized_bytes(model, p, n, batch)

    def fp(s: _Layer) -> float:
        return (s.sinks + window_capacity(s.window)) * tb + q(s.pending)

    def hist(s: _Layer) -> int:
        return s.blocks * bb + q(s.pending)

    pre, T = _Layer(), 0
    for c in schedule:
        take = max(0, min(c, p.sinks - T))
        w1 = pre.window + c - take  # the window after appending, before it is trimmed
        f = max(0, (w1 - p.window) // p.block) * p.block  # tokens leaving the window, quantized
        seals = (pre.pending + f) // block_tokens
        post = _Layer(pre.sinks + take, w1 - f, pre.pending + f - seals * block_tokens, pre.blocks + seals)
        fp_pre, fp_post, h_pre, h_post = fp(pre), fp(post), hist(pre), hist(post)  # the same for every layer
        mids = [(fp(m), hist(m)) for m in (_Layer(post.sinks, w1, pre.pending + f - j * block_tokens, pre.blocks + j)
                                           for j in range(1, seals + 1))]  # the state after each seal
        for layer in range(L):
            n_init = L if T else layer + 1  # layers holding anything count in the growth reserve
            growth = c * tb * n_init
            # the read of this layer's history (before it appends): layers < `layer` are done
            rest = L - layer
            dev.rebalance(layer * fp_post + rest * fp_pre, growth, max(h_post if layer else 0, h_pre))
            for fp_mid, h_mid in mids:  # each sealed block: rebalance, then put on the device
                dev.seal(dev.rebalance(layer * fp_post + fp_mid + (rest - 1) * fp_pre, growth,
                                       max(h_post if layer else 0, h_mid, h_pre if rest > 1 else 0)))
        pre, T = post, T + c
    return {"fp": fp(pre), "blocks": pre.blocks, "pending_bytes": q(pre.pending)}
