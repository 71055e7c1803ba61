"""``lessmem explore``: the quantization error explorer (bits × group size), as a command.

Example:
    $ lessmem explore --bits 2,3,4,8 --outliers --plot out.png
    $ lessmem explore --model smollm2-135m --list-tensors
    $ lessmem explore --model smollm2-135m --tensor blk.0.attn_q.weight --json
"""

from __future__ import annotations

import json
import math
import time

HELP = "quantization error explorer (bits x group size)"


def add_arguments(p) -> None:
    p.add_argument("--bits", default="2,3,4,8", help="comma-separated bit widths (2..8)")
    p.add_argument("--groups", default="8,16,32,64,128,channel,tensor",
                   help="group sizes along the input axis, 'channel' (one scale per output row), 'tensor'")
    p.add_argument("--schemes", default="sym,asym", help="sym (zero point 0), asym (min/max + zero point)")
    p.add_argument("--rows", default="128", help="synthetic matrix rows (default 128)")
    p.add_argument("--cols", default="1024", help="synthetic matrix columns (default 1024)")
    p.add_argument("--seed", default="11", help="seed of the synthetic matrix (default 11, the lecture's)")
    p.add_argument("--outliers", nargs="?", const=2, default=0, type=int,
                   help="add N outlier input channels (default 2 when given)")
    p.add_argument("--outlier-scale", default="100", help="outlier channels are N(0,1) x this (default 100)")
    p.add_argument("--group", default="32", help="group size of the outlier experiment and the picture")
    p.add_argument("--formats", default="auto",
                   help="GGUF types / codebooks / fp8 rows: 'auto' (all lessmem.formats has), 'none', or a list")
    p.add_argument("--model", default=None, help="built-in alias (smollm2-135m) or a .gguf file: use a real tensor")
    p.add_argument("--tensor", default=None, help="tensor name in the model file (see --list-tensors)")
    p.add_argument("--list-tensors", action="store_true", help="list the model file's tensors and exit")
    p.add_argument("--bandwidth", default="3.35TB/s", help="bandwidth for the traffic table's times")
    p.add_argument("--threads", default="1", help="torch threads (default 1: small tensors, shared CPUs)")
    p.add_argument("--plot", default=None, help="write a PNG: 128 weights and SNR-vs-bits curves")
    p.add_argument("--json", action="store_true", help="print JSON")


def _ints(text, what, lo=1):
    try:
        vals = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--{what}={text!r}: give comma-separated integers") from None
    if not vals or any(v < lo for v in vals):
        raise ValueError(f"--{what}={text!r}: values must be integers >= {lo}")
    return vals


def _num(text, what):
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--{what}={text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"--{what}={text!r} must be a positive number")
    return v


def explore(args) -> dict:
    """Everything the command shows, as one dict (what --json prints)."""
    import torch

    from ..base.units import parse_rate
    from . import explore as ex

    torch.set_num_threads(int(_num(args.threads, "threads")))
    bits = _ints(args.bits, "bits", 2)
    if any(b > 8 for b in bits):
        raise ValueError(f"--bits={args.bits!r}; allowed: 2, 3, 4, 5, 6, 7, 8")
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    groups = [s.strip() for s in args.groups.split(",") if s.strip()]
    group = _ints(args.group, "group")[0]
    bandwidth = parse_rate(args.bandwidth, "bandwidth")
    skipped: list[str] = []
    if args.model and not args.tensor:
        raise ValueError("--model needs --tensor NAME (or --list-tensors to see the names)")
    if args.model and args.tensor:
        w, info = ex.load_tensor(args.model, args.tensor)
        outlier_cols: list[int] = []
        source = {"kind": "model", "model": args.model, **info,
                  "note": f"stored as {info['stored_as']} in the file: its dequantized values are the reference"}
        if args.outliers:
            skipped.append("--outliers: applies to the synthetic matrix only; a real tensor has its own")
    elif args.tensor:
        raise ValueError("--tensor needs --model (e.g. --model smollm2-135m)")
    else:
        rows, cols = _ints(args.rows, "rows")[0], _ints(args.cols, "cols")[0]
        w, outlier_cols = ex.synthetic_weights(rows, cols, int(args.seed), args.outliers,
                                               _num(args.outlier_scale, "outlier-scale"))
        source = {"kind": "synthetic", "shape": [rows, cols], "seed": int(args.seed), "dist": "N(0, 1)",
                  "outlier_cols": outlier_cols, "outlier_scale": float(args.outlier_scale)}
    if w.shape[-1] % group:
        raise ValueError(f"--group={group} does not divide the {w.shape[-1]} columns; choose a divisor")
    table = ex.error_table(w, bits, groups, schemes, skipped)
    fmts = args.formats.strip().lower()
    names = None if fmts == "auto" else [] if fmts == "none" else [s.strip() for s in fmts.split(",")]
    formats = ex.formats_table(w, names, skipped)
    if names:
        missing = [n for n in names if n not in ex.available_formats(names)]
        if missing:
            raise ValueError(f"--formats: unknown {', '.join(missing)}; lessmem.formats has: "
                             f"{', '.join(ex.available_formats())}")
    exp_bits = 4 if 4 in bits else bits[0]
    outlier = ex.outlier_experiment(w, outlier_cols, exp_bits, group)
    traffic_fmts = [("int4", str(group)), ("int8", "channel")] + [
        (f, "") for f in ex.available_formats(("q4_0", "q4_k")) if w.shape[-1] % 256 == 0]
    traffic = ex.traffic_table(w, traffic_fmts, bandwidth=bandwidth)
    buys = ex.what_it_buys(exp_bits, group)
    return {"source": source, "table": table, "formats": formats, "outliers": outlier,
            "traffic": traffic, "bandwidth": bandwidth, "skipped": skipped, "what_it_buys": buys,
            "curves": ex.snr_curves(table, "sym" if "sym" in schemes else "asym")}


def _tables(r: dict):
    src = r["source"]
    shape = "x".join(map(str, src["shape"]))
    what = (f"{src['name']} of {src['model']} [{shape}] ({src['note']})" if src["kind"] == "model" else
            f"synthetic N(0,1) [{shape}], seed {src['seed']}"
            + (f", outlier channels {src['outlier_cols']} x{src['outlier_scale']:g}" if src["outlier_cols"] else ""))
    out = [(f"Bits x group size — {what}",
            ["bits", "group", "scheme", "bits/weight", "SNR dB", "max |err|", "vs fp16"],
            [[str(t["bits"]), t["group"], t["scheme"], f"{t['bits_per_weight']:.4g}", f"{t['snr_db']:.2f}",
              f"{t['max_abs_err']:.4g}", f"{t['compression']:.3g}x"] for t in r["table"]])]
    if r["formats"]:
        out.append(("GGUF types, codebooks, fp8 (each with its own default scales)",
                    ["format", "bits/weight", "SNR dB", "max |err|", "vs fp16"],
                    [[f["format"], f"{f['bits_per_weight']:.4g}", f"{f['snr_db']:.2f}", f"{f['max_abs_err']:.4g}",
                      f"{f['compression']:.3g}x"] for f in r["formats"]]))
    o = r["outliers"]
    g = f"g{o['group']}"
    rows = []
    for key in ("per_tensor", g):
        e = o[key]
        rows.append([e["granularity"], f"{e['snr_db']:.2f}", f"{e['snr_db_ordinary']:.2f}", f"{e['max_abs_err']:.4g}",
                     f"{e['mean_abs_err_ordinary_in_outlier_groups']:.4g}", f"{e['mean_abs_err_elsewhere']:.4g}"])
    out.append((f"Outliers, {o['scheme']} int{o['bits']}: per-tensor vs {g} — recovered "
                f"{o['recovered_db']:.1f} dB ({o['recovered_db_ordinary']:.1f} dB on ordinary weights)",
                ["scales", "SNR dB", "SNR dB ordinary", "max |err|", "mean |err| ordinary, outlier's group",
                 "mean |err| other groups"], rows))
    out.append((f"Per-group error, first {len(o['row0_original'])} weights of row 0, {g}",
                ["weights", "outliers", "max |err|", "max |err| ordinary"],
                [[f"{q['start']}-{q['stop'] - 1}", ",".join(map(str, q["outliers"])) or "-",
                  f"{q['max_abs_err']:.4g}", f"{q['ordinary_max_abs_err']:.4g}"] for q in o[g]["groups_row0"]]))
    out.append((f"Traffic of one decode matmul y = W·x, W [{shape}], batch 1 (times at "
                f"{r['bandwidth'] / 1e12:.3g} TB/s)",
                ["path", "format", "bytes read", "bytes written", "bytes/weight", "total", "vs fp16", "time"],
                [[t["path"], t["format"], f"{t['weight_read']:,}", f"{t['weight_written']:,}",
                  f"{t['bytes_per_weight']:.4g}", f"{t['total']:,}", f"{t['vs_fp16']:.3g}x",
                  f"{t['seconds_at_bandwidth'] * 1e6:.3g} µs"] for t in r["traffic"]]))
    b = r["what_it_buys"]
    out.append((f"What it buys — {b[0]['model']} on {b[0]['hardware']} (decode floor = weight bytes / bandwidth)",
                ["weights", "bits/weight", "scale share", "weights", "ms/token", "tok/s",
                 f"KV fp16 at {b[0]['context']:,} tokens", f"fits in {b[0]['fits_in'] / 2**30:g} GiB"],
                [[x["weights"], f"{x['bits_per_weight']:.3g}", f"{100 * x['scale_share']:.1f}%",
                  f"{x['weight_bytes'] / 2**30:.2f} GiB ({x['weight_bytes'] / 1e9:.2f} GB)",
                  f"{x['seconds_per_token'] * 1e3:.2f}", f"{x['tok_s']:.0f}",
                  f"{x['kv_fp16_bytes'] / 2**30:.1f} GiB", "yes" if x["fits"] else "no"] for x in b]))
    return out


def _print(tables) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, cols, rows in tables:
            print(title)
            print("  ".join(cols))
            for row in rows:
                print("  ".join(row))
            print()
        return
    con = Console(width=150, highlight=False)
    for title, cols, rows in tables:
        t = Table(title=title, title_justify="left")
        for c in cols:
            t.add_column(c)
        for row in rows:
            t.add_row(*row)
        con.print(t)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def run(args) -> int:
    t0 = time.perf_counter()
    if args.list_tensors:
        from .explore import list_tensors

        if not args.model:
            raise ValueError("--list-tensors needs --model (e.g. --model smollm2-135m)")
        ts = list_tensors(args.model)
        if args.json:
            print(json.dumps(ts, indent=1))
        else:
            for t in ts:
                print(f"{t['name']:32s} {t['type']:6s} {'x'.join(map(str, t['shape']))}")
        return 0
    r = explore(args)
    if args.plot:
        from .explore_plot import plot_explorer

        src = r["source"]
        title = (f"{src['name']} ({src['model']})" if src["kind"] == "model" else
                 f"synthetic N(0,1) seed {src['seed']}" + (", outlier channels" if src["outlier_cols"] else ""))
        r["plot"] = plot_explorer(args.plot, r["outliers"], r["curves"], title)
    r["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(_jsonable(r), indent=1))
        return 0
    _print(_tables(r))
    for s in r["skipped"]:
        print(f"skipped: {s}")
    if args.plot:
        print(f"wrote {r['plot']}")
    return 0
