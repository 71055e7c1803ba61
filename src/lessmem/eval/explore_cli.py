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

from lessmem import _cli_types as T
from lessmem._cli_model import peek_model

HELP = "quantization error explorer (bits x group size)"


MAX_COLS = 2**20
MAX_ELEMENTS = 2**24  # rows x cols of the synthetic matrix: 64 MiB of fp32
SIZES = ("channel", "per-channel", "row", "tensor", "per-tensor")


def _groups(text: str) -> list[str]:
    """``--groups``: comma-separated group sizes (1..2^20), 'channel' or 'tensor'."""
    parts = [x.strip().lower() for x in text.split(",") if x.strip()]
    ok = [x in SIZES or (x.removeprefix("g").isdigit() and 1 <= int(x.removeprefix("g")) <= MAX_COLS)
          for x in parts]
    if not parts or not all(ok):
        raise T.bad(text, f"allowed: comma-separated group sizes in [1, {MAX_COLS}], 'channel' or 'tensor'")
    return parts


def add_arguments(p) -> None:
    p.add_argument("--bits", type=T.int_list(2, 8), default="2,3,4,8", help="comma-separated bit widths (2..8)")
    p.add_argument("--groups", type=_groups, default="8,16,32,64,128,channel,tensor",
                   help="group sizes along the input axis, 'channel' (one scale per output row), 'tensor'")
    p.add_argument("--schemes", type=T.choice_list(("sym", "asym"), "schemes"), default="sym,asym",
                   help="sym (zero point 0), asym (min/max + zero point)")
    p.add_argument("--rows", type=T.integer(1, MAX_COLS), default="128", help="synthetic matrix rows (default 128)")
    p.add_argument("--cols", type=T.integer(1, MAX_COLS), default="1024",
                   help=f"synthetic matrix columns (default 1024; rows x cols at most {MAX_ELEMENTS:,})")
    p.add_argument("--seed", type=T.integer(0, 2**32 - 1), default="11",
                   help="seed of the synthetic matrix (default 11, the lecture's)")
    p.add_argument("--outliers", nargs="?", const=2, default=0, type=T.integer(0, 128),
                   help="add N outlier input channels, 0..128 (default 2 when given)")
    p.add_argument("--outlier-scale", type=T.number(0, 1e6, lo_open=True), default="100",
                   help="outlier channels are N(0,1) x this (default 100)")
    p.add_argument("--group", type=T.integer(1, MAX_COLS), default="32",
                   help="group size of the outlier experiment and the picture")
    p.add_argument("--formats", default="auto",
                   help="GGUF types / codebooks / fp8 rows: 'auto' (all lessmem.formats has), 'none', or a list")
    p.add_argument("--model", default=None, help="built-in alias (smollm2-135m) or a .gguf file: use a real tensor")
    p.add_argument("--tensor", default=None, help="tensor name in the model file (see --list-tensors)")
    p.add_argument("--list-tensors", action="store_true", help="list the model file's tensors and exit")
    p.add_argument("--bandwidth", type=T.rate(), default="3.35TB/s", help="bandwidth for the traffic table's times")
    p.add_argument("--threads", type=T.THREADS, default="1", help="torch threads (default 1: small tensors, shared CPUs)")
    p.add_argument("--plot", type=T.out_file((".png", ".svg", ".pdf")), default=None,
                   help="write a PNG (or .svg/.pdf): 128 weights and SNR-vs-bits curves")
    p.add_argument("--json", action="store_true", help="print JSON")


def _format_names(text: str) -> list[str] | None:
    """``--formats`` -> names (None = 'auto'); OptionError naming unknown ones."""
    from . import explore as ex

    fmts = text.strip().lower()
    if fmts == "auto":
        return None
    names = [] if fmts == "none" else [s.strip() for s in fmts.split(",") if s.strip()]
    missing = [n for n in names if n not in ex.available_formats(names)]
    if missing or (fmts != "none" and not names):
        raise T.OptionError("--formats", text, f"unknown {', '.join(missing) or 'empty list'}; allowed: "
                            f"auto, none or names out of {', '.join(ex.available_formats())}")
    return names


def check(args) -> None:
    """Every option combination checked before a matrix is made or a file read."""
    if args.model:
        from .explore import model_gguf_path

        try:
            path = model_gguf_path(args.model)
        except ValueError as exc:
            msg = str(exc).removeprefix(f"--model {args.model!r}: ").replace("give a built-in", "allowed: a built-in")
            if "allowed" not in msg:
                msg += "; allowed: an existing .gguf file or a built-in alias"
            raise T.OptionError("--model", args.model, msg) from None
        if peek_model(str(path)) is None:
            raise T.OptionError("--model", args.model, "not a valid GGUF file; allowed: a .gguf file "
                                "or a built-in alias")
    if args.list_tensors:
        if not args.model:
            raise T.OptionError("--list-tensors", None, "needs --model (e.g. --model smollm2-135m)")
        return
    if args.model and not args.tensor:
        raise T.OptionError("--model", args.model, "needs --tensor NAME (or --list-tensors to see the names)")
    if args.tensor and not args.model:
        raise T.OptionError("--tensor", args.tensor, "needs --model (e.g. --model smollm2-135m)")
    args.format_names = _format_names(args.formats)
    if not args.model:
        if args.rows * args.cols > MAX_ELEMENTS:
            raise T.OptionError("--cols", args.cols, f"rows x cols = {args.rows * args.cols:,}; allowed: "
                                f"at most {MAX_ELEMENTS:,} elements")
        if args.outliers > args.cols:
            raise T.OptionError("--outliers", args.outliers, f"allowed: at most --cols ({args.cols})")
        _check_group(args.group, args.cols)


def _check_group(group: int, cols: int) -> None:
    if cols % group:
        raise T.OptionError("--group", group, f"does not divide the {cols} columns; allowed: a divisor of {cols}")


def _read_gguf(what, *a):
    """``what(*a)`` on a GGUF file; a damaged file's parse error as a one-line ValueError."""
    try:
        return what(*a)
    except ValueError as exc:
        if str(exc).startswith("no tensor"):
            raise T.OptionError("--tensor", a[1], f"{exc}; allowed: a name --list-tensors shows") from None
        if "--model" not in str(exc):
            raise T.OptionError("--model", a[0], f"{exc}; allowed: a valid .gguf file") from None
        raise
    except Exception as exc:  # the gguf package fails on damaged files with many error types
        raise T.OptionError("--model", a[0], f"not a valid GGUF file ({type(exc).__name__}: {exc}); "
                            "allowed: a valid .gguf file") from exc


def _matrix(args, skipped: list[str]):
    """The weights to explore: a tensor of the model file, or the seeded synthetic matrix."""
    from . import explore as ex

    if args.model:
        w, info = _read_gguf(ex.load_tensor, args.model, args.tensor)
        if args.outliers:
            skipped.append("--outliers: applies to the synthetic matrix only; a real tensor has its own")
        return w, [], {"kind": "model", "model": args.model, **info,
                       "note": f"stored as {info['stored_as']} in the file: its dequantized values are the reference"}
    w, outlier_cols = ex.synthetic_weights(args.rows, args.cols, args.seed, args.outliers, args.outlier_scale)
    return w, outlier_cols, {"kind": "synthetic", "shape": [args.rows, args.cols], "seed": args.seed,
                             "dist": "N(0, 1)", "outlier_cols": outlier_cols, "outlier_scale": args.outlier_scale}


def explore(args) -> dict:
    """Everything the command shows, as one dict (what --json prints)."""
    import torch

    from ..base.units import parse_rate
    from . import explore as ex

    if not hasattr(args, "format_names"):
        check(args)
    torch.set_num_threads(args.threads)
    bits, schemes, groups, group = args.bits, args.schemes, args.groups, args.group
    bandwidth = parse_rate(args.bandwidth, "bandwidth")
    skipped: list[str] = []
    w, outlier_cols, source = _matrix(args, skipped)
    _check_group(group, w.shape[-1])  # a model's tensor: its width is known only now
    table = ex.error_table(w, bits, groups, schemes, skipped)
    formats = ex.formats_table(w, args.format_names, skipped)
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

        ts = _read_gguf(list_tensors, args.model)
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
