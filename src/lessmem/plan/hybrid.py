"""The hybrid strategy: quantize the KV cache, keep what fits in a budget, offload the rest.

For each precision and a KV budget on the device (the 16-request scenario's question):

- resident tokens per request n_r: the most tokens whose cache fits in budget / B
  (all of it for bare precisions: ⌊budget / (B · bytes_per_token)⌋; windows, sinks and
  scales counted for presets);
- offloaded tokens per request T − n_r, and their bytes, placed on host RAM over PCIe
  (NVMe when host RAM is full, or on a machine without a separate device memory);
- the streaming demand at a target rate R tokens/s (all requests together), two ways:
  *sliding*: attention limited to the resident window (an assumption the caller chooses), so
  each new token pushes one token's KV across the boundary: demand = bytes/token × R;
  *full*: attention reads every offloaded token every step: demand = offloaded bytes ×
  R / B (one step yields B tokens);
- whether the prefetch hides under compute: the transfer of one step's blocks takes
  less than the step's own device reads (weights + resident KV) ÷ HBM bandwidth.

Example:
    >>> from lessmem.plan import plan
    >>> h = plan("llama-3-8b", context=16384, batch=16, kv=["fp8"], kv_budget="4GiB")["hybrid"]
    >>> h["chosen"], h["rows"][0]["resident_tokens_per_request"], h["rows"][0]["offloaded_tokens_per_request"]
    ('fp8', 4096, 12288)
"""

from __future__ import annotations

from .kv import KVPrecision, bytes_per_token, kv_bytes

_QUALITY_RANK = {"reference": 0, "near-lossless": 1, "lossy": 2}


def resident_tokens(model, context: int, p: KVPrecision, per_request_budget: float) -> int:
    """Largest n ≤ context whose one-request cache fits ``per_request_budget`` bytes."""
    lo, hi = 0, context
    while lo < hi:  # bisection on the (piecewise non-decreasing) byte count
        mid = (lo + hi + 1) // 2
        if kv_bytes(model, mid, 1, p)["total"] <= per_request_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def hybrid_row(model, hw, p: KVPrecision, context: int, batch: int, budget: int,
               target_tps: float, weight_bytes: float) -> dict:
    per_req = budget / batch
    n_r = resident_tokens(model, context, p, per_req)
    full_req = kv_bytes(model, context, 1, p)["total"]
    res_req = kv_bytes(model, n_r, 1, p)["total"]
    off_tokens = context - n_r
    off_req = full_req - res_req
    off_total = off_req * batch
    bpt = bytes_per_token(model, p)
    # where the offloaded part lives
    if off_total == 0:
        placement = []
    elif hw.unified:
        placement = [{"tier": "nvme", "bytes": off_total, "bandwidth": hw.nvme_bw}]
    elif off_total <= hw.host_ram:
        placement = [{"tier": "host", "bytes": off_total, "bandwidth": hw.pcie_bw}]
    else:
        placement = [{"tier": "host", "bytes": hw.host_ram, "bandwidth": hw.pcie_bw},
                     {"tier": "nvme", "bytes": off_total - hw.host_ram, "bandwidth": hw.nvme_bw}]
    link = min((t["bandwidth"] for t in placement), default=None)
    link_tier = placement[-1]["tier"] if placement else None
    steps_per_s = target_tps / batch
    sliding_demand = bpt * target_tps if off_tokens else 0.0
    full_demand = off_total * steps_per_s
    compute_s = (weight_bytes + batch * res_req) / hw.hbm_bw
    sliding_step_s = (bpt * batch / link) if link else 0.0
    full_step_s = sum(t["bytes"] / t["bandwidth"] for t in placement)
    step_full = max(compute_s, full_step_s)
    return {
        "precision": p.name, "quality": p.quality, "bytes_per_token": bpt,
        "bytes_per_token_per_layer": bpt / model.layers,
        "kv_total": full_req * batch, "fits_entirely": off_tokens == 0,
        "resident_tokens_per_request": n_r, "resident_tokens_total": n_r * batch,
        "resident_fraction": n_r / context, "resident_bytes": res_req * batch,
        "offloaded_tokens_per_request": off_tokens, "offloaded_bytes_per_request": off_req,
        "offloaded_bytes_total": off_total, "offload_tier": link_tier, "placement": placement,
        "link_bandwidth": link,
        "target_tok_s": target_tps, "tok_s_per_request": steps_per_s,
        "seconds_per_token_per_request": 1 / steps_per_s,
        "sliding": {"demand_bytes_per_s": sliding_demand,
                    "link_fraction": sliding_demand / link if link else 0.0,
                    "transfer_s_per_step": sliding_step_s, "compute_s_per_step": compute_s,
                    "prefetch_hidden": sliding_step_s <= compute_s},
        "full": {"demand_bytes_per_s": full_demand,
                 "link_fraction": full_demand / link if link else 0.0,
                 "transfer_s_per_step": full_step_s, "compute_s_per_step": compute_s,
                 "prefetch_hidden": full_step_s <= compute_s,
                 "max_tok_s": batch / step_full if step_full else float("inf"),
                 "meets_target": (batch / step_full if step_full else float("inf")) >= target_tps},
        "compression_vs_fp16": model.kv_elements_per_token * 2 / bpt,
    }


def choose(rows: list[dict]) -> dict | None:
    """Pick a row: the most precise that fits entirely; otherwise the most compact among the
    best quality class offered that is at most near-lossless (fp8 before int4),
    falling back to the most compact of all."""
    fits = [r for r in rows if r["fits_entirely"]]
    if fits:
        return max(fits, key=lambda r: (-_QUALITY_RANK[r["quality"]], r["bytes_per_token"]))
    pool = [r for r in rows if r["resident_tokens_per_request"] > 0]
    near = [r for r in pool if _QUALITY_RANK[r["quality"]] == 1]
    # quantize as far as quality allows (fp8 halves the cache, near-lossless),
    # then offload the rest, rather than go lossy (int4) or stay at fp16 and offload more
    return min(near or pool, key=lambda r: r["bytes_per_token"]) if pool else None


def suggestions(model, hw, rows: list[dict], context: int, batch: int, budget: int,
                target_tps: float) -> list[str]:
    """What would make it fit or keep up, in words (with the numbers)."""
    from ..base.units import fmt_bytes, fmt_rate

    out = []
    if budget > hw.hbm_capacity:
        out.append(f"the KV budget {fmt_bytes(budget)} exceeds the device memory {fmt_bytes(hw.hbm_capacity)}")
    if not any(r["fits_entirely"] for r in rows):
        smallest = min(rows, key=lambda r: r["kv_total"])
        out.append(f"nothing asked fits entirely in {fmt_bytes(budget)}: {smallest['precision']} needs "
                   f"{fmt_bytes(smallest['kv_total'])} for {batch} x {context:,} tokens")
        per_req = smallest["kv_total"] / batch
        if per_req <= budget:
            out.append(f"{smallest['precision']} fits entirely with batch <= {int(budget // per_req)}")
    for r in rows:
        if r["resident_tokens_per_request"] == 0:
            out.append(f"{r['precision']}: the budget holds less than one token per request; "
                       f"a batch <= {max(int(budget // r['bytes_per_token']), 0)} or a budget >= "
                       f"{fmt_bytes(batch * r['bytes_per_token'])} would")
        elif r["offloaded_tokens_per_request"] and not r["full"]["meets_target"]:
            need = r["full"]["demand_bytes_per_s"]
            out.append(f"{r['precision']}: with full attention the offloaded part needs {fmt_rate(need)} "
                       f"at {target_tps:g} tok/s but the link gives {fmt_rate(r['link_bandwidth'])}; "
                       f"at most {r['full']['max_tok_s']:.3g} tok/s — use a sliding window, a smaller "
                       "precision or a faster link")
    return out
