"""Seconds from bytes: transfer times per tier, and the decode latency floor.

Decode is memory-bound: every step reads all the weights once and every request's
KV cache once, so  t_step ≥ (W + B·KV) / BW_device  and no kernel can beat it.
A step yields one token per request: B / t_step tokens/s in all.

Example:
    >>> from lessmem.plan.speed import transfer_times, decode_floor
    >>> from lessmem.plan.hardware import get_hardware
    >>> rows = transfer_times(4 * 2**30, get_hardware("generic-gpu"))
    >>> [round(r["seconds"] * 1e3, 1) for r in rows]
    [2.9, 171.8, 859.0]
    >>> round(decode_floor(16e9, 0, 1, 3.35e12)["tok_s"])
    209
"""

from __future__ import annotations


def transfer_times(nbytes: int, hw, step_budget_s: float | None = None) -> list[dict]:
    """Time to read ``nbytes`` from each tier of ``hw`` (data time; per-transfer latency aside).

    ``ratio_vs_device``: how many times slower than device memory (60x for PCIe, 300x for NVMe on the generic GPU).
    ``x_step_budget``: the transfer as a multiple of one decode step at the target rate.
    """
    rows = []
    base = None
    for t in hw.tiers():
        s = nbytes / t["bandwidth"]
        base = s if base is None else base
        row = {**t, "bytes": int(nbytes), "seconds": s, "ratio_vs_device": s / base if base else 1.0}
        if step_budget_s:
            row["x_step_budget"] = s / step_budget_s
        rows.append(row)
    return rows


def decode_floor(weight_bytes: float, kv_bytes_per_request: float, batch: int, bandwidth: float) -> dict:
    """Lower bound on one decode step when everything is read from ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth={bandwidth!r} must be positive")
    step_bytes = weight_bytes + batch * kv_bytes_per_request
    step_s = step_bytes / bandwidth
    return {
        "weight_bytes": int(weight_bytes), "kv_bytes": int(batch * kv_bytes_per_request),
        "bytes_per_step": int(step_bytes), "bandwidth": float(bandwidth), "batch": batch,
        "seconds_per_token": step_s,  # per request: each request gets one token per step
        "tok_s": 1.0 / step_s if step_s else float("inf"),
        "tok_s_aggregate": batch / step_s if step_s else float("inf"),
    }
