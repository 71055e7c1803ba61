"""``lessmem presets``: the named KV-cache presets with their settings and effective bits.

Effective bits count codes plus the fp16 scale and uint8 zero point of each group, at
the given ``--head-dim`` (64 for the built-in model; per-token groups span it).

Example:
    $ lessmem presets
    $ lessmem presets --json --head-dim 128
"""

from __future__ import annotations

import json

from lessmem import _cli_types as T

HELP = "list the named KV-cache presets"


def _head_dim(text: str) -> int:
    """``--head-dim``: a multiple of 8 from 8 to 1024."""
    v = T.integer()(text) if text.strip().lstrip("+-").isdigit() else None
    if v is None or not 8 <= v <= 1024 or v % 8:
        raise T.bad(text, "allowed: a positive multiple of 8, at most 1024")
    return v


def add_arguments(p) -> None:
    p.add_argument("--head-dim", type=_head_dim, default=64,
                   help="head_dim for effective bits, a multiple of 8 (default 64)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _gran(t) -> str:
    if not t.quantized:
        return "-"
    if t.per_channel:
        return f"chan/{t.granularity.size}t"
    g = t.granularity
    return f"tok/{g.size}c" if hasattr(g, "size") else "tok"


def _side(t) -> str:
    return "fp16" if not t.quantized else f"{t.format}{t.bits if t.format in ('int', 'uint', 'lm') else ''}"


def kv_rows(head_dim: int = 64) -> list[dict]:
    """One dict per KV preset: name, description, settings and effective bits."""
    from lessmem.kvcache import DESCRIPTIONS, PRESETS

    rows = []
    for name, cfg in PRESETS.items():
        kb, vb = cfg.effective_bits(head_dim)
        rot = "+".join(x for x, on in (("K", cfg.rotate_keys), ("V", cfg.rotate_values)) if on) or "-"
        rows.append({"kind": "kv", "name": name, "description": DESCRIPTIONS.get(name, ""),
                     "keys": f"{_side(cfg.keys)} {_gran(cfg.keys)}".strip(),
                     "values": f"{_side(cfg.values)} {_gran(cfg.values)}".strip(),
                     "window": cfg.window, "sinks": cfg.sinks, "block": cfg.block_size,
                     "rotation": rot, "k_bits": kb, "v_bits": vb, "config": cfg.to_dict()})
    return rows


def run(args) -> int:
    kv = kv_rows(args.head_dim)
    if args.json:
        print(json.dumps(kv, indent=2, default=str))
        return 0
    from rich.table import Table

    from lessmem._console import console as make_console

    table = Table(title=f"KV-cache presets (effective bits at head_dim {args.head_dim})")
    for col in ("name", "keys", "values", "window", "sinks", "rot", "K bits", "V bits"):
        table.add_column(col, justify="right" if "bits" in col or col in ("window", "sinks") else "left",
                         no_wrap=True)
    for r in kv:
        table.add_row(r["name"], r["keys"], r["values"], str(r["window"]), str(r["sinks"]), r["rotation"],
                      f"{r['k_bits']:.3f}", f"{r['v_bits']:.3f}")
    console = make_console()
    console.print(table)
    console.print("see `lessmem presets --json` for descriptions and full configs")
    return 0
