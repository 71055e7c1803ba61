"""``lessmem quantize``: quantize a model's weights and write a checkpoint or a GGUF file.

    lessmem quantize --model smollm2-135m --method gptq --bits 4 --group-size 128 --out DIR
    lessmem quantize --model smollm2-135m --method hqq --bits 3 --group-size 64 --out DIR
    lessmem quantize --model smollm2-135m --method fp8 --act none --out DIR
    lessmem quantize --model smollm2-135m --format gguf --type Q4_K_M --out model.gguf
    lessmem quantize --model smollm2-135m --format gguf --type Q4_K_M --method imatrix --out model.gguf
    lessmem quantize --model smollm2-135m --format gguf --type Q4_K_M --imatrix imatrix.gguf --out model.gguf
    lessmem quantize --model smollm2-135m --format gguf --type Q3_K_M --method gptq --out model.gguf

Without ``--group-size`` the group is 128, and where 128 does not divide a layer's
inputs (the built-in model's 576-wide layers) the largest of 64/32 that does, as
``--group-fallback`` (and the benchmarks) do; the summary counts the linears per group
size. Every option is checked before the model loads.

``--method fp8`` holds float8_e4m3fn weights with one float32 scale per output channel
(``weights.fp8``); ``--act fp8`` (the default) quantizes activations to FP8 per token
(W8A8, ``torch._scaled_mm``), ``--act none`` keeps them float (weight-only). Like
SmoothQuant, it ignores ``--bits``, ``--group-size`` and ``--symmetric``; the other
methods ignore ``--act``.

``--format gguf`` re-encodes a GGUF model (a .gguf file or a built-in alias) in the llama.cpp
mix ``--type``. ``--method imatrix`` first computes an importance matrix (llama.cpp's
``llama-imatrix``, ``weights.imatrix.collect_imatrix``: the model run over ``--n-samples``
windows of ``--seq-len`` tokens of the calibration text) and encodes every tensor it covers
with it, as ``llama-quantize --imatrix`` does; ``--imatrix FILE`` reads one instead
(llama.cpp's GGUF or legacy ``.dat`` format, checked, with its entries' lengths against the
model's tensors, before any work); ``--imatrix-out FILE`` writes the matrix used (GGUF for a
``.gguf`` name, else the legacy format). These three need ``--format gguf``.
``--method gptq`` with ``--format gguf`` runs GPTQ inside the file's blocks
(``weights.gguf_gptq``): the model's decoder blocks one by one over the calibration
windows, each block's scales chosen by llama.cpp's quantizer weighted by the importance
measured there, the codes with GPTQ's error feedback; the file is an ordinary llama.cpp
file of the same size. ``--format gguf`` takes ``--method`` rtn (llama.cpp's quantizer,
the default), imatrix or gptq.

``--calibration FILE`` picks the calibration text (default: the built-in corpus,
``pydoc_data.topics``); the summary says which was used. ``--json`` prints the report
as JSON instead of a table.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from lessmem import _cli_types as T
from lessmem._cli_model import check_model, peek_model
from lessmem._console import publish

HELP = "quantize a model's weights (RTN, HQQ, GPTQ, AWQ, SmoothQuant, FP8, GGUF)"
# methods only --format gguf takes, and why
GGUF_ONLY = {"imatrix": "an importance matrix steers llama.cpp's GGUF quantizers",
             "awq+gptq": "AWQ's scales, then GPTQ inside llama.cpp's blocks"}
METHODS = ("rtn", "hqq", "gptq", "awq", "smoothquant", "fp8", *GGUF_ONLY)
CHECKPOINT_METHODS = tuple(m for m in METHODS if m not in GGUF_ONLY)  # --format lessmem
# --format gguf: llama.cpp's quantizer, + imatrix, + GPTQ / AWQ / both inside the blocks
GGUF_METHODS = ("rtn", "imatrix", "gptq", "awq", "awq+gptq")
GGUF_CALIBRATED = GGUF_METHODS[2:]  # a calibration pass over the float model (solvers.solve_gguf)
ACTS = ("fp8", "none")
FORMATS = ("lessmem", "gguf")
DEFAULT_GROUP = 128
PER_CHANNEL = ("none", "0", "per-channel")


def _imatrix_file(text: str) -> Path:
    """``--imatrix``: an existing, non-empty file (its content is checked in ``check``)."""
    p = Path(text).expanduser()
    if not p.is_file():
        raise T.bad(text, "allowed: an existing imatrix file (llama.cpp GGUF or legacy .dat)")
    if p.stat().st_size == 0:
        raise T.bad(text, "the file is empty; allowed: an imatrix file (llama.cpp GGUF or legacy .dat)")
    return p


def _group_size(text: str) -> int | None:
    """``--group-size``: a positive integer or none/per-channel (None)."""
    if text.strip().lower() in PER_CHANNEL:
        return None
    return T.integer(1, 2**20)(text)


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, HF dir, .gguf file or hub id")
    p.add_argument("--method", type=T.choice(METHODS), default="rtn",
                   help=f"one of {', '.join(METHODS)} ({', '.join(GGUF_ONLY)}: with --format gguf)")
    p.add_argument("--bits", type=T.integer(1, 64), default=4, help="2, 3, 4 or 8")
    p.add_argument("--group-size", type=_group_size, default=None,
                   help=f"32, 64, 128, 256 or 'none' (per-channel); default {DEFAULT_GROUP}, with "
                        "--group-fallback where it does not divide a layer")
    p.add_argument("--symmetric", action="store_true", help="zero point fixed at 2^(bits-1)")
    p.add_argument("--group-fallback", action="store_true",
                   help="use a smaller group where the group size does not divide in_features")
    p.add_argument("--calibration", type=T.text_file, default=None,
                   help="calibration text file (default: built-in corpus)")
    p.add_argument("--n-samples", type=T.integer(1, 4096), default=32, help="calibration windows (1..4096)")
    p.add_argument("--seq-len", type=T.integer(8, T.MAX_TOKENS), default=512, help="tokens per calibration window")
    p.add_argument("--alpha", type=T.number(0, 1), default=0.5, help="SmoothQuant migration strength in [0, 1]")
    p.add_argument("--iters", type=T.integer(0, 1000), default=20, help="HQQ half-quadratic iterations")
    p.add_argument("--lp-norm", type=T.number(0, 1, lo_open=True), default=0.7, help="HQQ lp norm of the error, 0 < p <= 1")
    p.add_argument("--act", type=T.choice(ACTS), default="fp8",
                   help="--method fp8: fp8 (W8A8, FP8 activations per token) or none (weight-only)")
    p.add_argument("--format", type=T.choice(FORMATS), default="lessmem", help="lessmem (checkpoint dir) or gguf")
    p.add_argument("--type", default="Q4_K_M", help="GGUF type or mix for --format gguf")
    p.add_argument("--imatrix", type=_imatrix_file, default=None,
                   help="--format gguf: a llama.cpp importance matrix file (GGUF or legacy .dat) to encode with")
    p.add_argument("--imatrix-out", type=T.out_file(), default=None,
                   help="--format gguf: write the importance matrix used (.gguf: GGUF format, else legacy .dat)")
    p.add_argument("--out", required=True, help="output directory (or .gguf file)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def build_config(args):
    """The weight config the options describe; ValueError naming the option when invalid."""
    from . import AWQConfig, FP8Config, GPTQConfig, HQQConfig, RTNConfig, SmoothQuantConfig

    if args.method not in CHECKPOINT_METHODS:
        raise T.OptionError("--method", args.method, _method_allowed(args.method))
    gs = DEFAULT_GROUP if args.group_size is None else args.group_size
    common = dict(bits=args.bits, group_size=gs, symmetric=args.symmetric or args.bits == 8,
                  group_fallback=args.group_fallback or args.group_size is None)
    if args.bits == 8:
        common["group_size"] = None
    calib = dict(n_samples=args.n_samples, seq_len=args.seq_len)
    make = {"rtn": lambda: RTNConfig(**common), "hqq": lambda: HQQConfig(**common, iters=args.iters,
                                                                          lp_norm=args.lp_norm),
            "gptq": lambda: GPTQConfig(**common, **calib), "awq": lambda: AWQConfig(**common, **calib),
            "smoothquant": lambda: SmoothQuantConfig(alpha=args.alpha, **calib),
            "fp8": lambda: FP8Config(act=None if getattr(args, "act", "fp8") == "none" else "fp8")}[args.method]
    try:
        return make()
    except ValueError as exc:  # a config field named in the message: name its option
        m = re.search(r"\b(\w+)=", str(exc))
        opt = "--" + m.group(1).replace("_", "-") if m else None
        if opt and hasattr(args, m.group(1)):
            raise T.OptionError(opt, getattr(args, m.group(1)), str(exc)) from None
        raise


def _source_gguf(model: str) -> Path:
    from .. import models

    if model in getattr(models, "BUILTIN", {}):
        return models.builtin_gguf(model)
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return p
    raise T.OptionError("--model", model, "--format gguf needs a .gguf source model (a path or a "
                        f"built-in alias: {', '.join(models.BUILTIN)})")


def _check_groups(args, config, shape: dict | None) -> None:
    """--group-size against the model's layer widths, when its config is known before loading."""
    gs = getattr(config, "group_size", None)
    if not shape or gs is None:
        return
    sizes = [g for g in (32, 64, 128, 256) if g <= gs] if config.group_fallback else [gs]
    bad = sorted(f for f in shape["in_features"] if all(f % g for g in sizes))
    if bad:
        fits = [g for g in (32, 64, 128, 256) if all(f % g == 0 for f in shape["in_features"])]
        what = (f"no group up to the default {gs} divides" if args.group_size is None
                else "no group up to it divides" if config.group_fallback else "does not divide")
        allowed = ", ".join([*map(str, fits), "'none' (per-channel)"])
        raise T.OptionError("--group-size", args.group_size, f"{what} the model's layer widths "
                            f"{', '.join(map(str, bad))}; allowed here: {allowed}"
                            + ("" if config.group_fallback else ", or add --group-fallback"))


def _method_allowed(method: str) -> str:
    if method in GGUF_ONLY:
        return (f"needs --format gguf ({GGUF_ONLY[method]}); "
                f"allowed with --format lessmem: {', '.join(CHECKPOINT_METHODS)}")
    return f"allowed: {', '.join(METHODS)}"


def _check_imatrix(args) -> None:
    """--method imatrix / --imatrix / --imatrix-out with --format gguf: read and check the
    matrix given against the source model's tensors, before any work."""
    from ..formats.gguf_file import read_gguf_header
    from .imatrix import check_columns, read_imatrix

    given, out = getattr(args, "imatrix", None), getattr(args, "imatrix_out", None)
    args.imatrix_data = None
    if args.method not in GGUF_METHODS:
        raise T.OptionError("--method", args.method, f"--format gguf encodes with llama.cpp's block types; "
                            f"allowed: {', '.join(GGUF_METHODS)}")
    if args.method == "imatrix" and given is not None:
        raise T.OptionError("--imatrix", given, "choose one of --imatrix FILE (read a matrix) and "
                            "--method imatrix (compute one)")
    if args.method not in ("rtn", "imatrix") and (given is not None or out is not None):
        raise T.OptionError("--method", args.method, "--format gguf encodes with llama.cpp's quantizers; "
                            "allowed with --imatrix/--imatrix-out: imatrix (or none)")
    if out is not None:
        if given is None and args.method != "imatrix":
            raise T.OptionError("--imatrix-out", out, "needs --method imatrix (a matrix to compute) or "
                                "--imatrix FILE (one to convert)")
        if Path(out).resolve() == Path(args.out).resolve():
            raise T.OptionError("--imatrix-out", out, "is the --out file; allowed: another file")
    if args.method == "imatrix" or args.method in GGUF_CALIBRATED:
        shape = peek_model(str(args.source))
        ctx = shape and shape["context"]
        if ctx and args.seq_len > ctx:
            raise T.OptionError("--seq-len", args.seq_len, f"allowed: at most the model's context ({ctx:,})")
    if given is None:
        return
    try:
        im = read_imatrix(given)
    except ValueError as exc:
        raise T.OptionError("--imatrix", given, f"{exc}; allowed: a llama.cpp imatrix file (GGUF or "
                            "legacy .dat)") from None
    header = read_gguf_header(args.source)
    tensors = [(t.name, t.shape[0]) for t in header.tensors if len(t.shape) >= 2]
    try:
        missing = check_columns(im, tensors)
    except ValueError as exc:
        raise T.OptionError("--imatrix", given, f"{exc}; allowed: an imatrix computed for this model") from None
    if len(missing) == len(tensors):
        first = ", ".join(sorted(im.entries)[:2])
        raise T.OptionError("--imatrix", given, f"none of its {len(im)} entries ({first}, ...) names a "
                            f"tensor of {args.source.name}; allowed: an imatrix computed for this model")
    args.imatrix_data = im


def check(args) -> None:
    """Every option checked before the model loads or anything is written."""
    if args.format == "gguf":
        from ..base.gguf_rules import check_file_type

        args.out = T.apply("--out", T.out_file((".gguf",)), args.out)
        try:
            check_file_type(args.type)
        except ValueError as exc:
            raise T.OptionError("--type", args.type, str(exc)) from None
        args.source = _source_gguf(args.model)
        if peek_model(str(args.source)) is None:
            raise T.OptionError("--model", args.model, "not a valid GGUF file; allowed: a .gguf file "
                                "or a built-in alias")
        _check_imatrix(args)
        return
    if args.method == "imatrix":
        raise T.OptionError("--method", args.method, _method_allowed(args.method))
    for opt, value in (("--imatrix", getattr(args, "imatrix", None)),
                       ("--imatrix-out", getattr(args, "imatrix_out", None))):
        if value is not None:
            raise T.OptionError(opt, value, "needs --format gguf (an importance matrix steers llama.cpp's "
                                "GGUF quantizers)")
    check_model(args.model)
    args.out = T.apply("--out", T.out_dir, args.out)
    args.config = build_config(args)
    shape = peek_model(args.model)
    _check_groups(args, args.config, shape)
    ctx = shape and shape["context"]
    if args.config.needs_calibration and ctx and args.seq_len > ctx:
        raise T.OptionError("--seq-len", args.seq_len, f"allowed: at most the model's context ({ctx:,})")


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


def _fresh(out: Path):
    """A temporary sibling of ``out`` to write into, renamed to ``out`` when complete (so a
    failed run leaves no partial output), or ``out`` itself when it is an existing directory."""
    if out.is_dir():
        return out, None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    return (tmp / out.name if out.suffix.lower() == ".gguf" else tmp), tmp


def _commit(out: Path, written: Path, tmp: Path | None) -> None:
    """The finished output into place (the caller removes ``tmp`` whatever happens)."""
    if tmp is not None:
        publish(written, out)


def _group_counts(model) -> dict:
    """{group size: number of quantized linears} (what --group-fallback chose, layer by layer)."""
    from .fp8 import FP8Linear
    from .qlinear import QuantLinear

    counts: dict = {}
    for m in model.modules():
        if isinstance(m, FP8Linear):
            counts["per-channel"] = counts.get("per-channel", 0) + 1
        elif isinstance(m, QuantLinear):
            key = "per-channel" if m.group_size in (None, m.in_features) else str(m.group_size)
            counts[key] = counts.get(key, 0) + 1
    return counts


def _compute_imatrix(args):
    """--method imatrix: the source model run over the calibration text (weights.imatrix)."""
    from .. import models
    from .imatrix import collect_imatrix

    name = args.model if args.model in getattr(models, "BUILTIN", {}) else str(args.source)
    model, tok = models.load(name)  # the blocks as stored: what llama-imatrix runs, memory-lean
    return collect_imatrix(model, args.calibration, tok, n_samples=args.n_samples, seq_len=args.seq_len,
                           progress=not args.json)


def _write_imatrix_out(args, im) -> None:
    from .imatrix import write_imatrix

    out = Path(args.imatrix_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_imatrix(im, out)  # written whole or not at all


def _run_gguf(args) -> int:
    from .gguf_export import export_gguf

    if args.method in GGUF_CALIBRATED:
        return _run_gguf_calibrated(args)
    im = getattr(args, "imatrix_data", None)
    source = None
    if args.method == "imatrix":
        im = _compute_imatrix(args)
        source = f"computed: {args.n_samples} x {args.seq_len} tokens of {im.datasets[0]}"
    elif im is not None:
        source = str(args.imatrix)
    if im is not None and getattr(args, "imatrix_out", None) is not None:
        _write_imatrix_out(args, im)
    target, tmp = _fresh(args.out)
    try:
        if im is None:
            rep = export_gguf(args.source, target, args.type, progress=not args.json)
        else:
            from .imatrix import export_gguf_imatrix

            record = args.imatrix if args.method != "imatrix" else getattr(args, "imatrix_out", None)
            rep = export_gguf_imatrix(args.source, target, args.type, im, progress=not args.json,
                                      imatrix_file=record)
        _commit(args.out, target, tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rep["source"], rep["out"] = str(args.source), str(args.out)
    if im is not None:
        rep["imatrix"] = {"from": source, **rep["imatrix"]}
        if getattr(args, "imatrix_out", None) is not None:
            rep["imatrix"]["written"] = str(args.imatrix_out)
    _print(rep, args.json)
    return 0


def _run_gguf_calibrated(args) -> int:
    """--format gguf --method gptq|awq|awq+gptq: the float model encoded block by block
    (solvers.solve_gguf: AWQ's folded scales and/or GPTQ inside the blocks), written with the
    source file's metadata and its other tensors as export_gguf writes them (the norms AWQ
    folded its scales into from the model)."""
    from .. import models
    from .apply import quantize_
    from .config import GGUFConfig
    from .gguf_export import export_gguf_encoded

    name = args.model if args.model in getattr(models, "BUILTIN", {}) else str(args.source)
    model, tok = models.load(name, weights="float")  # the solvers read float weights
    config = GGUFConfig(args.type, gptq="gptq" in args.method, awq="awq" in args.method,
                        n_samples=args.n_samples, seq_len=args.seq_len)
    q = quantize_(model, config, calibration=args.calibration, tokenizer=tok, progress=not args.json)
    target, tmp = _fresh(args.out)
    try:
        rep = export_gguf_encoded(args.source, target, args.type, model, progress=not args.json)
        _commit(args.out, target, tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    per_layer = list(q["layers"].values())
    rep.update(source=str(args.source), out=str(args.out), method=args.method,
               calibration=q["calibration"]["source"],
               calibrated_linears=sum(1 for v in per_layer for e in v.values() if "type" in e),
               seconds=round(q["seconds"], 1))
    if config.awq:
        rep["awq_scales"] = sum(1 for v in per_layer for e in v.values() if "loss_best" in e)
    _print(rep, args.json)
    return 0


def run(args) -> int:
    if not hasattr(args, "source") and not hasattr(args, "config"):
        check(args)
    if args.format == "gguf":
        return _run_gguf(args)
    from .. import models
    from .apply import quantize_
    from .checkpoint import save_quantized

    config = args.config
    if args.group_size is None and getattr(config, "group_size", None):
        print(f"lessmem quantize: --group-size not given: {config.group_size}, and 64 or 32 where "
              f"{config.group_size} does not divide a layer's inputs", file=sys.stderr)
    model, tok = models.load(args.model, weights="float")  # quantizers read float weights
    rep = quantize_(model, config, calibration=args.calibration, tokenizer=tok, progress=not args.json)
    target, tmp = _fresh(args.out)
    try:
        save_quantized(model, target, tokenizer=tok)
        _commit(args.out, target, tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    summary = {"model": args.model, "method": config.method, "bits": getattr(config, "bits", 8),
               "group_size": getattr(config, "group_size", None), "group_sizes_used": _group_counts(model),
               "quantized_linears": rep["n_quantized"],
               "calibration": rep.get("calibration", {}).get("source", "none (no calibration)"),
               "seconds": round(rep["seconds"], 1), "out": str(args.out), "out_bytes": size}
    if config.method == "fp8":
        summary["act"] = config.act or "none (weight-only)"
    _print(summary, args.json)
    return 0
