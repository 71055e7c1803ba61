"""Tables for a plan dict: rich when importable, plain text otherwise.

Bytes are printed in binary units with the decimal value beside them wherever a reader
could mix up GiB and GB; bandwidths in GB/s (decimal, as vendors quote them).
"""

from __future__ import annotations

import math

from ..base.units import fmt_bytes, fmt_rate, fmt_time


def _pct(x: float) -> str:
    if not x:
        return "-"
    p = 100 * x
    return f"{p:.4f}%" if p < 0.01 else f"{p:.3g}%"


def _ms(s: float) -> str:
    return fmt_time(s)


def tables(p: dict) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, columns, rows, footnote) for each section of a plan."""
    out = [_kv_table(p), _weights_table(p), _transfer_table(p), _decode_table(p), _fits_table(p)]
    if p.get("hybrid"):
        out.append(_hybrid_table(p))
    out += [_split_table(sp) for sp in p.get("tier_split") or []]
    return out


def _kv_table(p: dict) -> tuple:
    m, inp = p["model"], p["inputs"]
    L, H, D = m["layers"], m["kv_heads"], m["head_dim"]
    return (
        f"KV cache — {m['name']} (L {L}, H_kv {H}, d {D}: 2·L·H_kv·d = {2 * L * H * D:,}·b bytes/token), "
        f"{inp['batch']} x {inp['context']:,} tokens",
        ["KV", "bytes/token", "per request", f"batch of {inp['batch']}", "vs fp16", "K/V bits (eff.)"],
        [[r["precision"], f"{fmt_bytes(r['per_token'], both=False)} ({r['per_token']:,.0f} B)",
          fmt_bytes(r["per_request"]), fmt_bytes(r["total"]),
          f"{r['compression_vs_fp16']:.3g}x ({_pct(r['fraction_of_fp16'])} of fp16)",
          f"{r['k_bits_effective']:.3g}/{r['v_bits_effective']:.3g}"] for r in p["kv"]],
        "bare names count codes only (2·L·H_kv·d·b); lessmem presets add scales, "
        "zero points, window and sinks",
    )


def _weights_table(p: dict) -> tuple:
    return (
        f"Weights — {p['model']['n_params'] / 1e9:.4g}B parameters",
        ["format", "bits/weight", "model bpw", "scale share", "scale tax", "footprint"],
        [[w["format"], f"{w['format_bpw']:.4g}", f"{w['model_bpw']:.4g}",
          _pct(w["scale_share"]), _pct(w["scale_tax"]), fmt_bytes(w["bytes"])] for w in p["weights"]],
        "scale share = metadata / all bits (int4 g32: 11.1%); scale tax = metadata / code bits "
        "(int4 g8: 50%); model bpw includes float norms and per-tensor types of mixes",
    )


def _transfer_table(p: dict) -> tuple:
    t, hw = p["transfer"], p["hardware"]
    return (
        f"Transfer of {fmt_bytes(t['bytes'])} — {hw['name']}",
        ["tier", "bandwidth", "time", "vs device", f"x {_ms(t['step_budget_s'])} step"],
        [[r["label"], fmt_rate(r["bandwidth"]), _ms(r["seconds"]), f"{r['ratio_vs_device']:.3g}x",
          f"{r['x_step_budget']:.3g}x"] for r in t["tiers"]],
        f"data time only; add ~{hw['pcie_latency_s'] * 1e6:.0f} µs per PCIe and "
        f"~{hw['nvme_latency_s'] * 1e6:.0f} µs per NVMe transfer; step = 1 / "
        f"{p['inputs']['target_tok_s']:g} tok/s",
    )


def _decode_table(p: dict) -> tuple:
    return (
        f"Decode floor — bytes read per step ÷ {fmt_rate(p['hardware']['hbm_bw'])}",
        ["weights", "KV", "bytes/step", "ms/token", "tok/s per request", "tok/s all"],
        [[d["weights"], d["kv"] or "(weights only, batch 1)", fmt_bytes(d["bytes_per_step"]),
          _ms(d["seconds_per_token"]), f"{d['tok_s']:.4g}", f"{d['tok_s_aggregate']:.4g}"]
         for d in p["decode"]],
        "a step reads every weight once and each request's whole KV cache once",
    )


def _fits_table(p: dict) -> tuple:
    return (
        f"Fits in {fmt_bytes(p['hardware']['hbm_capacity'])} device memory?",
        ["weights", "KV", "weights + KV", "fits"],
        [[f["weights"], f["kv"], fmt_bytes(f["bytes"]), "yes" if f["fits"] else "no"] for f in p["fits"]],
        "",
    )


def _hybrid_row(r: dict, chosen) -> list[str]:
    s, f = r["sliding"], r["full"]
    return [
        ("* " if r["precision"] == chosen else "") + r["precision"],
        f"{r['resident_tokens_total']:,} ({r['resident_tokens_per_request']:,}/req, "
        f"{_pct(r['resident_fraction'])})",
        f"{r['offloaded_tokens_per_request']:,}/req ({fmt_bytes(r['offloaded_bytes_per_request'], both=False)} each)"
        + (f" -> {r['offload_tier']}" if r["offload_tier"] else ""),
        "-" if not r["offload_tier"] else
        f"{fmt_rate(s['demand_bytes_per_s'])} = {_pct(s['link_fraction'])} of link; "
        f"{'hidden' if s['prefetch_hidden'] else 'NOT hidden'}",
        "-" if not r["offload_tier"] else
        f"{fmt_rate(f['demand_bytes_per_s'])} = {_pct(f['link_fraction'])} of link; "
        f"{'hidden' if f['prefetch_hidden'] else 'not hidden'}, max {f['max_tok_s']:.3g} tok/s",
    ]


def _hybrid_table(p: dict) -> tuple:
    h, inp = p["hybrid"], p["inputs"]
    first = h["rows"][0]
    return (
        f"Hybrid under a {fmt_bytes(h['budget'])} KV budget at {inp['target_tok_s']:g} tok/s in all "
        f"({first['tok_s_per_request']:.4g} tok/s, one token every {first['seconds_per_token_per_request']:.3g} s "
        "per request)",
        ["KV", "resident tokens", "offloaded", "stream, sliding window", "stream, full attention"],
        [_hybrid_row(r, h["chosen"]) for r in h["rows"]],
        "* = chosen: the most precise that fits, else the most compact near-lossless one, offloading "
        "the rest. Sliding: attention over the resident window only, one "
        "token's KV crosses per new token. Full: every offloaded token read every step."
        + ("".join("\n  - " + s for s in h["suggestions"])),
    )


def _split_table(sp: dict) -> tuple:
    """The tier split of one preset: blocks and bytes per tier, and the arguments to pass on."""
    rows = [["resident (sinks, window, partial blocks)", "-", "-", fmt_bytes(sp["resident_bytes"])]]
    for t in sp["tiers"]:
        name = t["tier"] + (f" {t['target']}" if t["target"] else "")
        cap = "unbounded" if t["capacity"] is None else fmt_bytes(t["capacity"])
        if t["tier"] == "device":
            cap = "--kv-budget " + ("none" if sp["kv_budget"] is None else fmt_bytes(sp["kv_budget"]))
        rows.append([name, cap, f"{t['blocks']:,}", fmt_bytes(t["bytes"])])
    if sp["lost_blocks"]:
        rows.append(["lost (the last tier is full)", "-", f"{sp['lost_blocks']:,}",
                     fmt_bytes(sp["lost_blocks"] * sp["block_bytes"])])
    warn = "" if sp["within_budget"] else (
        f"\n  the device needs {fmt_bytes(sp['needed_budget'])} at its peak (resident + the forward's new "
        "tokens + gathered histories): over --kv-budget")
    feed = (f"prompt in chunks of {sp['prefill_chunk']:,}"
            + (f", then {sp['decode_tokens']:,} tokens {sp['decode_chunk']} at a time" if sp["decode_tokens"] else ""))
    return (
        f"Tier split — {sp['precision']}, {sp['batch']} x {sp['context']:,} tokens, blocks of "
        f"{sp['block_tokens']} tokens per layer ({fmt_bytes(sp['block_bytes'], both=False)} each), {feed}",
        ["tier", "capacity", "blocks", "bytes"], rows,
        f"pass to lessmem generate / eval: {sp['args']}" + warn,
    )


def render(p: dict, console=None) -> str:
    """The plan as text (rich tables when rich is installed)."""
    ts = tables(p)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        return "\n\n".join(_plain(*t) for t in ts) + "\n"
    import io

    buf = io.StringIO()
    con = console or Console(file=buf, width=160, highlight=False, force_terminal=False)
    for title, cols, rows, foot in ts:
        tab = Table(title=title, title_justify="left", caption=foot or None, caption_justify="left")
        for c in cols:
            tab.add_column(c, overflow="fold")
        for r in rows:
            tab.add_row(*r)
        con.print(tab)
    return buf.getvalue() if console is None else ""


def _plain(title, cols, rows, foot) -> str:
    w = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w[i]) for i, c in enumerate(cols))
    body = ["  ".join(str(r[i]).ljust(w[i]) for i in range(len(cols))) for r in rows]
    return "\n".join([title, line, "-" * len(line), *body] + ([foot] if foot else []))


def fmt_demand(bps: float) -> str:
    """A small rate in the coarse way capacity planning writes it: KiB/s = MiB/s ≈ GB/s."""
    return f"{bps / 1024:,.6g} KiB/s = {bps / 1024**2:,.6g} MiB/s ≈ {bps / 1e9:.2g} GB/s"


def summary(p: dict) -> str:
    """One paragraph: the headline numbers."""
    h = p.get("hybrid")
    if not h or not h["chosen"]:
        return ""
    r = next(r for r in h["rows"] if r["precision"] == h["chosen"])
    if r["fits_entirely"]:
        return f"{r['precision']}: the whole cache fits in the budget; nothing to offload."
    return (f"{r['precision']}: {r['resident_tokens_total']:,} tokens resident in all "
            f"({r['resident_tokens_per_request']:,} per request), {r['offloaded_tokens_per_request']:,} per "
            f"request offloaded to {r['offload_tier']} ({fmt_bytes(r['offloaded_bytes_per_request'])} each); "
            f"streaming with a sliding window: {fmt_bytes(r['bytes_per_token'], both=False)}/token x "
            f"{r['target_tok_s']:g} tok/s = {fmt_demand(r['sliding']['demand_bytes_per_s'])} "
            f"({_pct(r['sliding']['link_fraction'])} of the link).") if not math.isnan(r["bytes_per_token"]) else ""
