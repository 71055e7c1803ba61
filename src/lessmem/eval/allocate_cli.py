"""``lessmem kv-allocate``: per-layer KV bits for one model under a bits budget.

Measures how much each layer's keys and values cost at each bit width on calibration
text (``lessmem.eval.allocate.measure_sensitivity``; about 15 minutes per 512-token
window for the built-in model's 30 layers on two cores, so ``--sensitivity FILE`` keeps
the table and later runs read it), then writes the allocation of least measured cost whose
bits, with window and sinks counted at ``--context`` tokens, fit ``--bits``. The file is a
KVConfig that ``--kv`` takes wherever it takes a preset name.

``--channels`` then spends each layer's key bits per channel
(``lessmem.eval.channels``: the bits go where queries meet large key errors; the keys are
stored unrotated, their channels sorted by bits), calibrated on ``--text`` in one forward pass
per window.

Example:
    $ lessmem kv-allocate --bits 3.5 --text wiki.train.raw --sensitivity sens.json --out kv-3.5.json
    $ lessmem eval --kv kv-3.5.json,best-3 --text wikitext2
"""

from __future__ import annotations

import json
import sys

from lessmem import _cli_types as T
from lessmem._cli_model import add_weights_option, check_model

HELP = "per-layer KV bits from measured sensitivity, under a bits budget (writes a --kv file)"
LAYOUTS = ("best-3", "best-4", "best-2", "kivi-2", "kivi-4", "int4", "int4-rot")


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in alias, .gguf file, HF directory or hub id (default: smollm2-135m)")
    add_weights_option(p)
    p.add_argument("--bits", type=T.number(1.0, 16.0), required=True,
                   help="mean bits per K/V element, codes, scales, window and sinks counted at --context")
    p.add_argument("--out", type=T.out_file((".json",)), required=True, help="the KVConfig to write (.json)")
    p.add_argument("--context", type=T.integer(1, T.MAX_TOKENS), default=None,
                   help="tokens at which the window and sinks are counted (default: the model's context)")
    p.add_argument("--layout", choices=LAYOUTS, default="best-3",
                   help="preset whose formats, groups, window, sinks and rotation every layer keeps; "
                        "only the bits change (default best-3)")
    p.add_argument("--choices", type=T.int_list(2, 8), default="2,3,4",
                   help="bit widths a side may take (default 2,3,4)")
    p.add_argument("--sensitivity", type=T.out_file((".json",)), default=None,
                   help="read the measured table from this file when it exists, else measure and write it")
    p.add_argument("--text", type=T.text_source, default="pydoc",
                   help="calibration text: pydoc, wikitext2, or a text FILE (default: pydoc)")
    p.add_argument("--windows", type=T.integer(1, 10_000), default=2, help="windows measured (default 2)")
    p.add_argument("--window-len", type=T.integer(64, T.MAX_TOKENS), default=512,
                   help="tokens per window (default 512)")
    p.add_argument("--chunk", type=T.integer(1, T.MAX_TOKENS), default=32,
                   help="tokens per step after the prefill (default 32)")
    p.add_argument("--channels", action="store_true",
                   help="spend each layer's key bits per channel, calibrated on --text (keys stored "
                        "unrotated, sorted by their bits; lowers the error of 2- and 3-bit keys)")
    p.add_argument("--threads", type=T.THREADS, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _layout(args):
    from lessmem.kvcache.presets import PRESETS

    return PRESETS[args.layout]


def check(args) -> None:
    """Everything known before the model loads: the bit choices fit the layout's formats, a
    given sensitivity file matches them, the model can be named."""
    from lessmem.eval.allocate import Sensitivity

    layout = _layout(args)
    choices = tuple(sorted(set(args.choices)))
    try:
        Sensitivity(layout, choices, [[0.0] * len(choices)], [[0.0] * len(choices)])
    except ValueError as exc:
        raise T.OptionError("--choices", ",".join(map(str, args.choices)), f"{exc} ({args.layout}'s "
                            f"keys are {layout.keys.format}, values {layout.values.format})") from None
    args.choices = choices
    if args.channels and not (layout.keys.format == "uint" and layout.keys.per_channel):
        raise T.OptionError("--channels", "", f"{args.layout}'s keys are {layout.keys.format} "
                            f"{layout.keys.granularity!r}; allowed: a --layout with uint keys per channel "
                            "(best-3, best-4, best-2, kivi-2, kivi-4)")
    if args.bits < choices[0]:
        raise T.OptionError("--bits", args.bits, f"allowed: at least {choices[0]} (the lowest of "
                            "--choices, before scales, window and sinks add to it)")
    args.table = None
    if args.sensitivity is not None and args.sensitivity.exists():
        try:
            d = json.loads(args.sensitivity.read_text())
            # this command's file, or a benchmark's that holds one under "sensitivity"
            args.table = Sensitivity.from_dict(d.get("sensitivity", d) if isinstance(d, dict) else d)
        except (ValueError, TypeError, OSError, UnicodeDecodeError) as exc:
            raise T.OptionError("--sensitivity", str(args.sensitivity), f"not a table this command "
                                f"wrote ({exc}); allowed: a file from --sensitivity, or a new path") from None
        if args.table.template != layout or args.table.bits != choices:
            raise T.OptionError("--sensitivity", str(args.sensitivity), f"measured for bits "
                                f"{args.table.bits} on another layout; allowed: a table of --layout "
                                f"{args.layout} with --choices {','.join(map(str, choices))}, or a new path")
    check_model(args.model)


def run(args) -> int:
    import torch

    from lessmem.base.corpus import load_text
    from lessmem.eval.allocate import (
        all_in_bits,
        allocate_all_in,
        check_budget,
        measure_sensitivity,
    )
    from lessmem.eval.cli import write_atomic
    from lessmem.eval.generate_cli import load_model, set_threads
    from lessmem.eval.report import Progress, quiet_transformers
    from lessmem.kvcache.shape import head_dim

    if not hasattr(args, "table"):
        check(args)
    prog = Progress(not args.no_progress, name="kv-allocate")
    quiet_transformers()
    set_threads(args.threads)
    prog.say(f"loading {args.model} ...")
    model, tok = load_model(args.model, dtype=torch.float32, weights=args.weights)
    cfg = model.config
    n, kv_heads, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg)
    context = args.context or getattr(cfg, "max_position_embeddings", None) or 4096
    layout = _layout(args)
    try:  # the budget against this model's shape, before any measuring
        check_budget(layout, args.choices[0], args.bits, n, kv_heads, hd, context)
    except ValueError as exc:
        raise T.OptionError("--bits", args.bits, str(exc)) from None
    if args.table is not None and args.table.num_layers != n:
        raise T.OptionError("--sensitivity", str(args.sensitivity), f"measured on {args.table.num_layers} "
                            f"layers; allowed: a table of this model's {n} layers, or a new path")
    sens = args.table
    if sens is None:
        text_name, text = load_text(args.text)
        prog.say(f"measuring {n} layers x keys/values x bits {','.join(map(str, args.choices))} on "
                 f"{args.windows} x {args.window_len} tokens of {text_name}")
        with prog.steps("sensitivity"):
            sens = measure_sensitivity(model, tok, text, layout, args.choices, windows=args.windows,
                                       window_len=args.window_len, chunk=args.chunk, progress=prog)
        if args.sensitivity is not None:
            write_atomic(args.sensitivity, json.dumps(sens.to_dict(), indent=1) + "\n")
            prog.say(f"wrote {args.sensitivity}")
    out = allocate_all_in(sens, args.bits, kv_heads=kv_heads, head_dim=hd, context=context)
    print(f"keys   bits by layer: {''.join(str(out.for_layer(i)[0].bits) for i in range(n))}")
    print(f"values bits by layer: {''.join(str(out.for_layer(i)[1].bits) for i in range(n))}")
    if args.channels:
        from lessmem.eval.channels import calibrate_channels
        from lessmem.eval.perplexity import make_windows

        text_name, text = load_text(args.text)
        prog.say(f"key bits per channel: {args.windows} x {args.window_len} tokens of {text_name}")
        out = calibrate_channels(model, make_windows(tok, text, args.windows, args.window_len), None, out)
    write_atomic(args.out, json.dumps(out.to_dict(), indent=1) + "\n")
    kb, vb = out.effective_bits(hd, num_layers=n)
    measured = "" if args.channels else f"; summed measured KLD {sens.cost(out):.5f}"
    print(f"K {kb:.3f} / V {vb:.3f} effective bits; {all_in_bits(out, n, kv_heads, hd, context):.3f} "
          f"with window and sinks at {context} tokens{measured}")
    print(f"wrote {args.out}  (use it: lessmem eval --kv {args.out})")
    return 0


def main(argv=None) -> int:  # python -m lessmem.eval.allocate_cli
    from lessmem.cli import main as lessmem_main

    return lessmem_main(["kv-allocate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
