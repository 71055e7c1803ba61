"""``plan()``: every number of the planner for one model, machine and workload, as a dict.

All values are in base units — bytes, seconds, bytes/s, tokens — so scripts need no
unit parsing; ``lessmem.plan.report`` turns the dict into tables.

Example:
    >>> from lessmem.plan import plan
    >>> p = plan("llama-3-8b", context=16384, batch=16, kv=["fp16", "fp8", "int4"])
    >>> [r["per_token"] for r in p["kv"]]
    [131072.0, 65536.0, 32768.0]
    >>> [r["total"] / 2**30 for r in p["kv"]]
    [32.0, 16.0, 8.0]
"""

from __future__ import annotations

from ..base.units import parse_bytes, parse_count, parse_rate
from .hardware import DEFAULT_HARDWARE, get_hardware
from .hybrid import choose, hybrid_row, suggestions
from .kv import bytes_per_token, get_kv, kv_bytes
from .models import get_model
from .speed import decode_floor, transfer_times

DEFAULT_KV = ("fp16", "fp8", "int8", "int4")


def _listify(x, default):
    if x is None:
        return list(default)
    if isinstance(x, str):
        return [s for s in (t.strip() for t in x.split(",")) if s]
    return list(x)


def _positive_int(name, v, allow_zero=False):
    if isinstance(v, str):
        v = parse_count(v, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}={v!r} must be a whole number")
    if v < (0 if allow_zero else 1):
        raise ValueError(f"{name}={v} must be {'>= 0' if allow_zero else 'a positive number of tokens' if name == 'context' else '>= 1'}")
    return v


def parse_params(v) -> float:
    """A parameter count: 8e9, "8e9", "8B", "134.5M", "70b" (decimal: K 1e3, M 1e6, B 1e9, T 1e12)."""
    import re

    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*", str(v), re.I)
        if not m:
            raise ValueError(f"params={v!r} is not a parameter count; use e.g. 8e9, 8B or 134.5M")
        x = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    if not x > 0:
        raise ValueError(f"params={v!r} must be positive")
    return x


def plan(model="llama-3-8b", *, context=None, batch=1, kv=None, weights="fp16",
         hardware=DEFAULT_HARDWARE, kv_budget=None, target_tps=25.0, buffer=None,
         params=None, keep_embeddings=False, offload=None, block_tokens=256, prefetch=True,
         prefill_chunk=None, decode_tokens=0, decode_chunk=1, **hw_overrides) -> dict:
    """Memory, bandwidth and tier split for ``batch`` requests of ``context`` tokens.

    model: preset name or config.json path; kv: precisions (names or KVPrecision);
    weights: one or more weight formats (the first drives the decode and hybrid rows);
    hardware: preset name, with overrides ``hbm_bw``, ``hbm_capacity``, ``pcie_gen``,
    ``pcie_width``, ``pcie_bw``, ``host_ram``, ``nvme_bw`` (numbers or "25GB/s", "80GiB");
    kv_budget: device bytes for the KV cache (enables the hybrid section); target_tps:
    tokens/s for all requests together; buffer: bytes for the transfer table (default:
    the budget, else the first precision's whole cache); params: override the parameter
    count (e.g. a round 8e9).

    offload: the tiers below the device as ``lessmem generate --offload`` takes them
    (``"host@1GiB,disk:/path"``): adds ``tier_split``, one :func:`lessmem.plan.tiers.tier_split`
    per lessmem cache preset in ``kv`` (default ``lessmem:int4`` when ``kv`` is not given),
    with ``block_tokens``, ``prefetch``, ``prefill_chunk``, ``decode_tokens`` and
    ``decode_chunk`` as there.
    """
    m = get_model(model)
    if params is not None:
        m = m.with_params(parse_params(params))
    context = m.max_context if context is None else _positive_int("context", context)
    batch = _positive_int("batch", batch)
    hw = get_hardware(hardware, **_hardware_overrides(hw_overrides))
    precs = [get_kv(s, num_layers=m.layers) for s in _listify(kv, DEFAULT_KV if offload is None else ["lessmem:int4"])]
    if not precs:
        raise ValueError("kv: give at least one KV precision")
    from .weights import get_weight_format, weight_footprint

    wfmts = [get_weight_format(w) for w in _listify(weights, ["fp16"])]
    if not wfmts:
        raise ValueError("weights: give at least one weight format")
    if not target_tps or target_tps <= 0:
        raise ValueError(f"target_tps={target_tps!r} must be positive")

    kv_rows = [_kv_row(m, context, batch, p) for p in precs]
    w_rows = [weight_footprint(m, f, keep_embeddings) for f in wfmts]
    budget = None if kv_budget is None else parse_bytes(kv_budget, "kv_budget")
    splits = None
    if offload is not None:
        splits = _tier_splits(m, precs, context, batch, budget, offload, block_tokens, prefetch,
                              prefill_chunk, decode_tokens, decode_chunk)
    step_budget = 1.0 / target_tps
    buf = parse_bytes(buffer, "buffer") if buffer is not None else (budget or kv_rows[0]["total"])
    out = {
        "model": m.to_dict(), "hardware": hw.to_dict(),
        "inputs": {"context": context, "batch": batch, "kv": [p.name for p in precs],
                   "weights": [f.name for f in wfmts], "kv_budget": budget, "target_tok_s": target_tps,
                   "buffer": buf},
        "kv": kv_rows, "weights": w_rows,
        "transfer": {"bytes": buf, "step_budget_s": step_budget,
                     "tiers": transfer_times(buf, hw, step_budget)},
        **_decode_and_fits(w_rows, kv_rows, batch, hw),
    }
    if splits is not None:
        out["tier_split"] = splits
    if budget is not None:
        out["hybrid"] = _hybrid(m, hw, precs, context, batch, budget, target_tps, w_rows[0]["bytes"])
    return out


def _hardware_overrides(hw_overrides: dict) -> dict:
    """``hbm_bw="3.35TB/s"``, ``host_ram="512GiB"``... as numbers; None values dropped."""
    ov = {}
    for k, v in hw_overrides.items():
        if v is None:
            continue
        if k in ("hbm_bw", "pcie_bw", "nvme_bw"):
            v = parse_rate(v, k) if isinstance(v, str) else float(v)
            if v <= 0:
                raise ValueError(f"{k}={v!r} must be positive")
        elif k in ("hbm_capacity", "host_ram"):
            v = parse_bytes(v, k)
            if v <= 0:
                raise ValueError(f"{k}={v!r} must be positive")
        ov[k] = v
    return ov


def _kv_row(m, context: int, batch: int, p) -> dict:
    """``kv_bytes`` for one precision, with raw/quantized per-token bytes and the fp16 ratio."""
    r = kv_bytes(m, context, batch, p)
    r["per_token_bytes_raw"] = m.kv_elements_per_token * (p.k_bits + p.v_bits) / 16  # codes only
    r["per_quantized_token"] = bytes_per_token(m, p)  # codes + amortised scales, no window
    r["compression_vs_fp16"] = r["fp16"] / r["total"] if r["total"] else None
    r["fraction_of_fp16"] = r["total"] / r["fp16"] if r["fp16"] else None
    r["quality"], r["description"] = p.quality, p.description
    return r


def _decode_and_fits(w_rows: list, kv_rows: list, batch: int, hw) -> dict:
    """Decode floors (each weight format alone, then the first with each KV precision) and
    whether weights + KV fit the device."""
    w0 = w_rows[0]["bytes"]
    decode = [dict(decode_floor(w["bytes"], 0, 1, hw.hbm_bw), weights=w["format"], kv=None)
              for w in w_rows]
    for r in kv_rows:
        decode.append(dict(decode_floor(w0, r["per_request"], batch, hw.hbm_bw),
                           weights=w_rows[0]["format"], kv=r["precision"]))
    fits = [{"weights": w_rows[0]["format"], "kv": r["precision"], "bytes": w0 + r["total"],
             "capacity": hw.hbm_capacity, "fits": w0 + r["total"] <= hw.hbm_capacity} for r in kv_rows]
    return {"decode": decode, "fits": fits}


def _tier_splits(m, precs, context, batch, budget, offload, block_tokens, prefetch,
                 prefill_chunk, decode_tokens, decode_chunk) -> list:
    """One ``tier_split`` per quantized lessmem cache preset among ``precs``."""
    from .kv import LESSMEM
    from .tiers import tier_split

    presets = [p for p in precs if p.name in LESSMEM and p.k_bits < 16]
    if not presets:
        raise ValueError(f"offload needs a quantized lessmem cache preset in kv, got "
                         f"{', '.join(p.name for p in precs)}; allowed: "
                         f"{', '.join(n for n, p in LESSMEM.items() if p.k_bits < 16)}")
    return [tier_split(m, p, context, batch, budget, offload, block_tokens, prefetch,
                       prefill_chunk, decode_tokens, decode_chunk=decode_chunk) for p in presets]


def _hybrid(m, hw, precs, context, batch, budget, target_tps, weight_bytes) -> dict:
    """The resident/offloaded split of each precision under ``budget`` and the one chosen."""
    one = min(kv_bytes(m, 1, 1, p)["total"] for p in precs)
    if budget < one:
        raise ValueError(f"kv_budget={budget} bytes is below one token ({one} bytes per token at the "
                         f"smallest precision asked); give at least {one} bytes, e.g. 4GiB")
    rows = [hybrid_row(m, hw, p, context, batch, budget, target_tps, weight_bytes) for p in precs]
    chosen = choose(rows)
    return {"budget": budget, "rows": rows, "chosen": chosen["precision"] if chosen else None,
            "suggestions": suggestions(m, hw, rows, context, batch, budget, target_tps)}
