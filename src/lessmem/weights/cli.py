"""``lessmem quantize``: quantize a model's weights and write a checkpoint or a GGUF file.

    lessmem quantize --model smollm2-135m --method gptq --bits 4 --group-size 128 --out DIR
    lessmem quantize --model smollm2-135m --method hqq --bits 3 --group-size 64 --out DIR
    lessmem quantize --model smollm2-135m --format gguf --type Q4_K_M --out model.gguf

``--calibration FILE`` picks the calibration text (default: the built-in corpus,
``pydoc_data.topics``); the summary says which was used. ``--json`` prints the report
as JSON instead of a table.
"""

from __future__ import annotations

import json
from pathlib import Path

HELP = "quantize a model's weights (RTN, HQQ, GPTQ, AWQ, SmoothQuant, GGUF)"
METHODS = ("rtn", "hqq", "gptq", "awq", "smoothquant")


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, HF dir, .gguf file or hub id")
    p.add_argument("--method", default="rtn", help=f"one of {', '.join(METHODS)}")
    p.add_argument("--bits", type=int, default=4, help="2, 3, 4 or 8")
    p.add_argument("--group-size", default="128", help="32, 64, 128, 256 or 'none' (per-channel)")
    p.add_argument("--symmetric", action="store_true", help="zero point fixed at 2^(bits-1)")
    p.add_argument("--group-fallback", action="store_true",
                   help="use a smaller group where the group size does not divide in_features")
    p.add_argument("--calibration", default=None, help="calibration text file (default: built-in corpus)")
    p.add_argument("--n-samples", type=int, default=32, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    p.add_argument("--iters", type=int, default=20, help="HQQ half-quadratic iterations")
    p.add_argument("--lp-norm", type=float, default=0.7, help="HQQ lp norm of the error, 0 < p <= 1")
    p.add_argument("--format", default="lessmem", help="lessmem (checkpoint dir) or gguf")
    p.add_argument("--type", default="Q4_K_M", help="GGUF type or mix for --format gguf")
    p.add_argument("--out", required=True, help="output directory (or .gguf file)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def build_config(args):
    from . import AWQConfig, GPTQConfig, HQQConfig, RTNConfig, SmoothQuantConfig

    if args.method not in METHODS:
        raise ValueError(f"--method {args.method!r}; allowed: {', '.join(METHODS)}")
    gs = None if str(args.group_size).lower() in ("none", "0", "per-channel") else int(args.group_size)
    common = dict(bits=args.bits, group_size=gs, symmetric=args.symmetric or args.bits == 8,
                  group_fallback=args.group_fallback)
    if args.bits == 8:
        common["group_size"] = None
    calib = dict(n_samples=args.n_samples, seq_len=args.seq_len)
    if args.method == "rtn":
        return RTNConfig(**common)
    if args.method == "hqq":
        return HQQConfig(**common, iters=args.iters, lp_norm=args.lp_norm)
    if args.method == "gptq":
        return GPTQConfig(**common, **calib)
    if args.method == "awq":
        return AWQConfig(**common, **calib)
    return SmoothQuantConfig(alpha=args.alpha, **calib)


def _source_gguf(model: str) -> Path:
    from .. import models

    if model in getattr(models, "BUILTIN", {}):
        return models.builtin_gguf(model)
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return p
    raise ValueError(f"--format gguf needs a .gguf source model (a path or a built-in alias), "
                     f"got {model!r}")


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=1, default=str))
        return
    try:
        from rich.table import Table

        from lessmem._console import console

        t = Table(title="lessmem quantize")
        t.add_column("field")
        t.add_column("value")
        for k, v in report.items():
            t.add_row(k, json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
        console().print(t)
    except ImportError:
        for k, v in report.items():
            print(f"{k}: {v}")


def run(args) -> int:
    if args.format not in ("lessmem", "gguf"):
        raise ValueError(f"--format {args.format!r}; allowed: lessmem, gguf")
    if args.format == "gguf":
        from .gguf_export import export_gguf

        src = _source_gguf(args.model)
        rep = export_gguf(src, args.out, args.type, progress=not args.json)
        rep["source"] = str(src)
        rep["out"] = args.out
        _print(rep, args.json)
        return 0
    config = build_config(args)
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise ValueError(f"--calibration {args.calibration!r} is not a file")
    from .. import models
    from .apply import quantize_
    from .checkpoint import save_quantized

    model, tok = models.load(args.model)
    calibration = Path(args.calibration) if args.calibration else None
    rep = quantize_(model, config, calibration=calibration, tokenizer=tok, progress=not args.json)
    save_quantized(model, args.out, tokenizer=tok)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    summary = {"model": args.model, "method": config.method, "bits": config.bits,
               "group_size": config.group_size, "quantized_linears": rep["n_quantized"],
               "calibration": rep.get("calibration", {}).get("source", "none (no calibration)"),
               "seconds": round(rep["seconds"], 1), "out": args.out, "out_bytes": size}
    _print(summary, args.json)
    return 0
