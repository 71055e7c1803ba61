"""Per-layer KV bits from measured sensitivity: mixed precision under a mean-bits budget.

Layers of one model differ widely in how much a coarser cache costs: on the built-in
model, 2-bit keys in layer 20 move the next-token distribution 230 times more than in
layer 0 (``benchmarks/results/kv_layer_sensitivity.json``). Spending the bits where they
matter is the idea of KVTuner (Li et al., "KVTuner: Sensitivity-Aware Layer-wise Mixed
Precision KV Cache Quantization", ICML 2025, arXiv:2502.04420); here it is done in two
measured steps:

1. :func:`measure_sensitivity` runs the evaluation protocol
   (:func:`lessmem.eval.perplexity.evaluate`) once, with one cache per (layer, side,
   bits): that layer's keys (or values) at ``bits``, its other side at int8 (nearly
   exact: KLD 4e-5 with every layer at int8), every other layer unquantized. The KLD
   against the unquantized cache is the cost of that choice.
2. :func:`allocate` picks each layer's key and value bits so that the summed cost is the
   least possible while the mean effective bits (codes, scales and zero points, over keys
   and values of every layer) stay within the budget: a multiple-choice knapsack over the
   2 x layers sides, solved exactly by dynamic programming over code bits (the metadata
   of a side does not depend on its bits, so a budget in effective bits is one in code
   bits). Costs are taken as additive over layers; the result is checked by evaluating
   it (``benchmarks/tune_kv_presets.py --which mixed``).

The result is an ordinary :class:`~lessmem.kvcache.KVConfig` with ``layer_overrides``:
save it with ``to_dict`` (JSON) and give the file wherever a preset name is taken
(``lessmem eval --kv kv.json``, ``lessmem generate``, ``lessmem serve``).

Example:
    >>> from lessmem.kvcache import PRESETS
    >>> template = PRESETS["best-3"]
    >>> s = Sensitivity(template, (2, 3, 4), keys=[[9.0, 1.0, 0.1], [0.5, 0.2, 0.1]],
    ...                 values=[[0.3, 0.1, 0.0], [0.3, 0.1, 0.0]])
    >>> cfg = allocate(s, mean_bits=3.5, head_dim=64)
    >>> [(cfg.for_layer(i)[0].bits, cfg.for_layer(i)[1].bits) for i in range(2)]
    [(4, 3), (3, 3)]
    >>> round(sum(cfg.effective_bits(64, num_layers=2)) / 2, 3)
    3.469
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lessmem.kvcache.config import ConfigTypeError, KVConfig, KVTensorConfig
from lessmem.plan.kv import kv_bytes

#: the other side of a layer while one side is measured: int8 per token (nearly exact)
_NEAR_EXACT = KVTensorConfig("int", 8)


@dataclass
class Sensitivity:
    """Measured cost (KLD, nats per token) of each layer's keys and values at each of ``bits``.

    ``template``: the KVConfig whose key/value formats, granularity, window, sinks, block
    and rotation the measurement used (and the allocation keeps); ``keys[layer][i]`` and
    ``values[layer][i]``: the cost of that side of that layer at ``bits[i]``.
    """

    template: KVConfig
    bits: tuple[int, ...]
    keys: list[list[float]]
    values: list[list[float]]
    protocol: dict | None = None

    def __post_init__(self):
        if not isinstance(self.template, KVConfig):
            raise ConfigTypeError(f"template={self.template!r}; allowed: a KVConfig")
        self.bits = tuple(int(b) for b in self.bits)
        if not self.bits or len(set(self.bits)) != len(self.bits):
            raise ValueError(f"bits={self.bits!r}; allowed: distinct bit widths, at least one")
        for side in ("keys", "values"):
            fmt = getattr(self.template, side)
            for b in self.bits:
                KVTensorConfig(fmt.format, b, fmt.granularity, fmt.clip_ratio)  # refuses bad bits
            rows = getattr(self, side)
            if not rows or any(len(r) != len(self.bits) for r in rows):
                raise ValueError(f"{side}: one row of {len(self.bits)} costs per layer (bits "
                                 f"{self.bits}); got {[len(r) for r in rows] or 'no rows'}")
            if any(not (isinstance(c, (int, float)) and math.isfinite(c)) for r in rows for c in r):
                raise ValueError(f"{side}: costs must be finite numbers")
        if len(self.keys) != len(self.values):
            raise ValueError(f"keys has {len(self.keys)} layers and values {len(self.values)}; "
                             "allowed: the same number")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def cost(self, cfg: KVConfig) -> float:
        """The summed measured cost of ``cfg``'s per-layer bits (what :func:`allocate`
        minimizes; the KLD it predicts if costs add up over layers)."""
        return sum(self.keys[i][self.bits.index(k.bits)] + self.values[i][self.bits.index(v.bits)]
                   for i, (k, v) in enumerate(map(cfg.for_layer, range(self.num_layers))))

    def to_dict(self) -> dict:
        return {"template": self.template.to_dict(), "bits": list(self.bits), "keys": self.keys,
                "values": self.values, "protocol": self.protocol}

    @staticmethod
    def from_dict(d: dict) -> Sensitivity:
        if not isinstance(d, dict) or set(d) != {"template", "bits", "keys", "values", "protocol"}:
            raise ValueError("Sensitivity.from_dict: allowed: a dict as written by to_dict() (keys "
                             "template, bits, keys, values, protocol)")
        return Sensitivity(KVConfig.from_dict(d["template"]), d["bits"], d["keys"], d["values"],
                           d["protocol"])


def _side(t: KVTensorConfig, bits: int) -> KVTensorConfig:
    return replace(t, bits=bits)


def probe_configs(template: KVConfig, num_layers: int, bits=(2, 3, 4)) -> dict[str, KVConfig]:
    """The caches :func:`measure_sensitivity` evaluates, by name ``L{layer}-k{bits}`` /
    ``L{layer}-v{bits}``: one side of one layer at ``bits``, everything else as described
    in the module doc."""
    none = KVTensorConfig("none", 16)
    base = template.replace(keys=none, values=none, skip_layers=(), layer_overrides=())
    out = {}
    for layer in range(num_layers):
        for b in bits:
            out[f"L{layer}-k{b}"] = base.replace(
                layer_overrides=((layer, _side(template.keys, b), _NEAR_EXACT),))
            out[f"L{layer}-v{b}"] = base.replace(
                layer_overrides=((layer, _NEAR_EXACT, _side(template.values, b)),))
    return out


def measure_sensitivity(model, tok, text: str, template: KVConfig, bits=(2, 3, 4), *,
                        windows: int = 2, window_len: int = 512, chunk: int = 32,
                        progress=None) -> Sensitivity:
    """Each layer's cost per side and bit width on ``text`` (see the module doc).

    ``template``: formats, granularity, window and rotation to measure (e.g.
    ``PRESETS["best-3"]``). Runs ``6 x num_layers`` caches (for three bit widths) through
    the protocol: about 15 minutes per 512-token window on two CPU cores for the built-in
    model's 30 layers. ``progress(done, total)`` as in ``evaluate``.
    """
    from lessmem.eval.caches import CacheSpec
    from lessmem.eval.perplexity import evaluate
    from lessmem.kvcache import KVCache, enable

    n = model.config.num_hidden_layers
    probes = probe_configs(template, n, bits)

    def factory(cfg):
        return lambda model_config: KVCache(model_config, cfg)

    specs = [CacheSpec(name, factory(cfg), "lessmem", cfg.to_dict()) for name, cfg in probes.items()]
    with enable(model):
        rows = evaluate(model, tok, specs, text, windows, window_len, chunk, progress=progress,
                        warmup=False)
    kld = {r["config"]: max(float(r["kld"]), 0.0) for r in rows}
    keys = [[kld[f"L{i}-k{b}"] for b in bits] for i in range(n)]
    values = [[kld[f"L{i}-v{b}"] for b in bits] for i in range(n)]
    protocol = {k: rows[0][k] for k in ("windows", "window_len", "chunk", "prefill", "tokens_scored")}
    return Sensitivity(template, tuple(bits), keys, values, protocol)


def _meta_bits(t: KVConfig, head_dim: int) -> float:
    """Mean metadata bits (scales, zero points) per K/V element of ``t``'s two sides: the same
    at every bit width, so a budget in effective bits is one in code bits."""
    return (t.keys.effective_bits(head_dim) - t.keys.bits + t.values.effective_bits(head_dim) - t.values.bits) / 2


def _code_budget(sens: Sensitivity, mean_bits: float, meta: float) -> int:
    """Code bits over the 2 x layers sides that ``mean_bits`` effective bits leave."""
    n = sens.num_layers
    return min(int(math.floor(2 * n * mean_bits - n * 2 * meta + 1e-9)), 2 * n * max(sens.bits))


def _least_costs(sens: Sensitivity, budget: int) -> list[tuple[float, tuple]]:
    """``best[c]``: (least summed cost, bits picked per side, keys then values) over every
    side using exactly ``c`` code bits, for ``c`` up to ``budget`` (a multiple-choice
    knapsack, solved exactly; the entries below ``budget`` do not depend on it)."""
    bits = sens.bits
    inf = float("inf")
    best: list[tuple[float, tuple]] = [(0.0, ())] + [(inf, ())] * budget
    for row in list(sens.keys) + list(sens.values):
        nxt = [(inf, ())] * (budget + 1)
        for c, (cost, picks) in enumerate(best):
            if cost == inf:
                continue
            for b, item_cost in zip(bits, row, strict=True):
                if c + b <= budget and cost + item_cost < nxt[c + b][0]:
                    nxt[c + b] = (cost + item_cost, picks + (b,))
        best = nxt
    return best


def _config(sens: Sensitivity, best: list[tuple[float, tuple]], limit: int) -> KVConfig:
    """The KVConfig of the least-cost entry of ``best`` within ``limit`` code bits."""
    t, n = sens.template, sens.num_layers
    _, picks = min(best[:limit + 1], key=lambda x: (x[0], sum(x[1])))
    pairs = list(zip(picks[:n], picks[n:], strict=True))
    common = max(set(pairs), key=lambda p: (pairs.count(p), p))  # the base; the rest override it
    overrides = tuple((i, _side(t.keys, kb), _side(t.values, vb))
                      for i, (kb, vb) in enumerate(pairs) if (kb, vb) != common)
    return t.replace(keys=_side(t.keys, common[0]), values=_side(t.values, common[1]),
                     skip_layers=(), layer_overrides=overrides)


def allocate(sens: Sensitivity, mean_bits: float, head_dim: int) -> KVConfig:
    """The per-layer bits of least summed cost whose mean effective bits (keys and values of
    every layer, metadata counted) are at most ``mean_bits``; a KVConfig on ``sens.template``.

    ValueError when ``mean_bits`` is below what the lowest bits cost."""
    meta = _meta_bits(sens.template, head_dim)
    lo, hi = min(sens.bits) + meta, max(sens.bits) + meta
    if isinstance(mean_bits, bool) or not isinstance(mean_bits, (int, float)) or not math.isfinite(mean_bits):
        raise ConfigTypeError(f"mean_bits={mean_bits!r}; allowed: a number from {lo:.3f} to {hi:.3f}")
    if mean_bits < lo - 1e-9:
        raise ValueError(f"mean_bits={mean_bits!r}; allowed: at least {lo:.3f} (every side at "
                         f"{min(sens.bits)} bits with its scales)")
    budget = _code_budget(sens, mean_bits, meta)
    return _config(sens, _least_costs(sens, budget), budget)


@dataclass(frozen=True)
class _Dims:
    layers: int
    kv_heads: int
    head_dim: int


def all_in_bits(cfg: KVConfig, layers: int, kv_heads: int, head_dim: int, context: int) -> float:
    """Mean bits per K/V element of one sequence of ``context`` tokens, everything counted:
    codes, scales, zero points, the full-precision window and sinks (the planner's bytes,
    :func:`lessmem.plan.kv.kv_bytes`)."""
    plan = kv_bytes(_Dims(layers, kv_heads, head_dim), context, 1, cfg.to_plan("mixed", num_layers=layers))
    return 16 * plan["total"] / plan["fp16"]


def check_budget(template: KVConfig, lowest: int, bits: float, layers: int, kv_heads: int,
                 head_dim: int, context: int) -> None:
    """ValueError unless an allocation on ``template`` can fit ``bits`` all-in bits: every
    side at ``lowest`` bits must (:func:`all_in_bits` at ``context`` tokens)."""
    t = template
    floor = t.replace(keys=_side(t.keys, lowest), values=_side(t.values, lowest), skip_layers=(),
                      layer_overrides=())
    low = all_in_bits(floor, layers, kv_heads, head_dim, context)
    if bits < low - 1e-9:
        raise ValueError(f"bits={bits!r} at {context} tokens; allowed: at least {low:.3f} (every side at "
                         f"{lowest} bits, scales, window and sinks counted)")


def allocate_all_in(sens: Sensitivity, bits: float, *, kv_heads: int, head_dim: int,
                    context: int) -> KVConfig:
    """:func:`allocate` at the largest mean effective bits whose :func:`all_in_bits` at
    ``context`` tokens is at most ``bits`` (the budget with window and sinks counted).

    ValueError when even the lowest bits exceed it."""
    n, t, b0 = sens.num_layers, sens.template, min(sens.bits)
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not math.isfinite(bits):
        raise ConfigTypeError(f"bits={bits!r}; allowed: a number of bits per K/V element")
    check_budget(t, b0, bits, n, kv_heads, head_dim, context)
    meta = _meta_bits(t, head_dim)
    floor = min(b0 + meta, bits)
    top, least = _code_budget(sens, max(bits, floor), meta), _code_budget(sens, floor, meta)
    best = _least_costs(sens, top)  # solved once: each smaller budget reads the same table
    for limit in range(top, least, -1):  # one code bit of one side of one layer less at a time
        cfg = _config(sens, best, limit)
        if all_in_bits(cfg, n, kv_heads, head_dim, context) <= bits + 1e-9:
            return cfg
    return _config(sens, best, least)  # every side at the lowest bits (check_budget: it fits)
