"""Presenting evaluation results: a rich table, JSON rows, a Δppl-vs-bits plot.

Example:
    >>> rows = [{"config": "dynamic", "ppl": 10.0, "delta_ppl_pct": 0.0, "kld": 0.0,
    ...          "top1": 1.0, "k_bits": 32.0, "v_bits": 32.0, "kv_bytes": 2**20,
    ...          "fp16_kv_bytes": 2**19, "compression": 0.5, "tok_per_s": 50.0}]
    >>> json_rows(rows)[0]["kv_mib"]
    1.0
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MIB = 1024 * 1024
JSON_KEYS = ("config", "kind", "ppl", "delta_ppl_pct", "kld", "top1", "k_bits", "v_bits",
             "kv_bytes", "fp16_kv_bytes", "compression", "tok_per_s", "speed_vs_baseline",
             "tokens_scored", "model", "text", "windows", "window_len", "chunk", "prefill")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def json_rows(rows: list[dict], passkey: dict | None = None) -> list[dict]:
    """One JSON-able object per config (protocol included; NaN -> null)."""
    out = []
    for r in rows:
        o = {k: r[k] for k in JSON_KEYS if k in r}
        o["kv_mib"] = r["kv_bytes"] / MIB
        for k in ("memory", "detail", "offload"):
            if k in r:
                o[k] = r[k]
        if passkey and r["config"] in passkey:
            p = passkey[r["config"]]
            o["passkey"] = {"accuracy": p["accuracy"], "found": p["found"], "trials": p["trials"],
                            "by_length": p["by_length"]}
        out.append(_clean(o))
    return out


def dumps(rows: list[dict], passkey: dict | None = None) -> str:
    return json.dumps(json_rows(rows, passkey), indent=2)


def _f(v, fmt):
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def print_table(rows: list[dict], passkey: dict | None = None, console=None) -> None:
    """A rich table: bits, KV MiB and compression, ppl, Δ%, KLD, top-1, tok/s (+ passkey)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze into 80 columns
            console = Console(width=160)
    r0 = rows[0]
    title = (f"{r0['model']} on {r0['text']}: {r0['windows']} x {r0['window_len']} tokens, "
             f"prefill {r0['prefill']}, chunk {r0['chunk']}")
    t = Table(title=title, caption=(
        "K/V bits: per element over the quantized tokens, scales and zero points included "
        "(unquantized: the bits held). KV MiB: bytes held after the full window. "
        "KLD and top-1 vs DynamicCache. tok/s: chunked decode."))
    for col in ("config", "K/V bits", "KV MiB", "x fp16", "ppl", "Δppl %", "KLD", "top-1",
                "tok/s", "x speed"):
        t.add_column(col, justify="left" if col == "config" else "right")
    if passkey:
        t.add_column("passkey", justify="right")
    for r in rows:
        cells = [
            r["config"],
            f"{_f(r['k_bits'], '.2f')}/{_f(r['v_bits'], '.2f')}",
            _f(r["kv_bytes"] / MIB, ".2f"),
            _f(r["compression"], ".2f"),
            _f(r["ppl"], ".3f"),
            _f(r["delta_ppl_pct"], "+.2f"),
            _f(r["kld"], ".5f"),
            _f(100 * r["top1"], ".1f") + "%",
            _f(r["tok_per_s"], ".1f"),
            _f(r.get("speed_vs_baseline"), ".2f"),
        ]
        if passkey:
            p = passkey.get(r["config"])
            cells.append(f"{p['found']}/{p['trials']}" if p else "—")
        t.add_row(*cells)
    console.print(t)


def plot(rows: list[dict], path: str | Path) -> Path:
    """Scatter of Δppl % against mean effective bits ((k_bits + v_bits) / 2), one point per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # unquantized caches (>= 16 bits) are the y = 0 reference line, not points
    pts = [r for r in rows if math.isfinite(r["delta_ppl_pct"])
           and math.isfinite((r["k_bits"] + r["v_bits"]) / 2) and (r["k_bits"] + r["v_bits"]) / 2 < 16]
    for i, r in enumerate(sorted(pts, key=lambda r: ((r["k_bits"] + r["v_bits"]) / 2, r["delta_ppl_pct"]))):
        bits = (r["k_bits"] + r["v_bits"]) / 2
        ax.scatter(bits, r["delta_ppl_pct"], s=30, color="tab:gray" if r.get("kind") == "peer" else "tab:blue")
        ax.annotate(r["config"], (bits, r["delta_ppl_pct"]), textcoords="offset points",
                    xytext=(5, 6 if i % 2 == 0 else -11), fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6, label="unquantized (DynamicCache)")
    ax.set_xlabel("effective bits per K/V element (mean of K and V)")
    ax.set_ylabel("Δ perplexity vs DynamicCache (%)")
    ds = [r["delta_ppl_pct"] for r in pts] or [0.0]
    log = any(abs(d) > 5 for d in ds)
    if log:
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(min(-0.5, 1.5 * min(ds)), max(ds) * (4 if log else 1.15) + 0.5)
    ax.legend(loc="upper right", fontsize=8)
    r0 = rows[0]
    ax.set_title(f"{r0['model']}, {r0['text']}: {r0['windows']}x{r0['window_len']} tokens, chunk {r0['chunk']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
