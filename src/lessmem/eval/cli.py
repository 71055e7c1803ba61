"""``lessmem eval``: perplexity, KLD, top-1, bytes, speed (and passkey) per KV cache config.

With no arguments (a quick run, under a minute on two cores): the built-in model on
the built-in text (Python's docs), one window of 512 tokens, the unquantized
``DynamicCache`` against four presets (int8, int4, best-4, best-2). ``--full``: the
main presets on two windows of 1024 tokens. Progress goes to stderr, one line per
stage (also when stderr is a file or pipe); transformers' loading bars and logs are
quiet.

Example:
    $ lessmem eval                                   # the README's main job (quick)
    $ lessmem eval --full                            # the main presets, 2 x 1024 tokens
    $ lessmem eval --kv int4,kivi-2,quanto-int4 --windows 8 --window-len 1024 --json
    $ lessmem eval --text wikitext2 --passkey 1024,4096 --plot kv.png
    $ lessmem eval --kv int4,kivi-2 --kv-budget 64MiB --offload host@1GiB,disk:/tmp/kv

With ``--offload`` every lessmem config runs in a ``TieredKVCache`` over those tiers
(the baseline and peer caches stay in memory); the tiered cache is bit-exact, so ppl,
KLD and top-1 equal the in-memory cache's, and the table is followed by where the bytes
were after each window (bytes per tier, device peak vs ``--kv-budget``); ``--json`` rows
carry the same under ``"offload"``. The passkey test runs the in-memory caches.
"""

from __future__ import annotations

import os
import sys

from lessmem import _cli_types as T
from lessmem._cli_model import (
    add_device_option,
    add_weights_option,
    check_model,
    peek_model,
    to_device,
)
from lessmem._console import publish

HELP = "measure perplexity, KLD, retrieval, bytes and speed of KV caches"

MAIN_PRESETS = ("fp8", "int8", "int4", "kivi-4", "kivi-2", "best-4", "best-2")
QUICK_PRESETS = ("int8", "int4", "best-4", "best-2")
# (windows, window_len): the default quick run, and --full
QUICK_PROTOCOL = (1, 512)
FULL_PROTOCOL = (2, 1024)
DEFAULT_CHUNK = 16
DTYPES = ("float32", "bfloat16", "float16")
MIN_WINDOW_LEN = 8  # lessmem.eval.perplexity.MIN_WINDOW_LEN (not imported: it pulls in torch)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in alias, .gguf file, HF directory or hub id (default: smollm2-135m)")
    add_weights_option(p)
    p.add_argument("--text", type=T.text_source, default="pydoc",
                   help="pydoc (built-in: Python's docs), wikitext2, or a text FILE (default: pydoc)")
    p.add_argument("--kv", default=None,
                   help="comma-separated configs: lessmem presets, peers (quanto-int4, quanto-int2, "
                        "hqq-int4, hf-fp8), 'presets' (all lessmem presets), 'peers' (all installed "
                        f"peers); default: {','.join(QUICK_PRESETS)} (--full: {','.join(MAIN_PRESETS)}). "
                        "A lessmem preset or KVConfig .json may take field=value changes after colons "
                        "(best-4:sliding=quantize). DynamicCache is always the baseline")
    p.add_argument("--full", action="store_true",
                   help=f"the full table: the main presets on {FULL_PROTOCOL[0]} windows of {FULL_PROTOCOL[1]} "
                        "tokens (several minutes on two cores); --kv/--windows/--window-len still win")
    p.add_argument("--windows", type=T.integer(1, 100_000), default=None,
                   help=f"number of windows (default {QUICK_PROTOCOL[0]}; --full: {FULL_PROTOCOL[0]})")
    p.add_argument("--window-len", type=T.integer(MIN_WINDOW_LEN, T.MAX_TOKENS), default=None,
                   help=f"tokens per window; the first quarter is prefilled (default {QUICK_PROTOCOL[1]}; "
                        f"--full: {FULL_PROTOCOL[1]})")
    p.add_argument("--chunk", type=T.integer(1, T.MAX_TOKENS), default=DEFAULT_CHUNK,
                   help=f"tokens per decode step after the prefill; 1 = exact decoding (default {DEFAULT_CHUNK})")
    p.add_argument("--passkey", type=T.int_list(64, T.MAX_TOKENS, empty_ok=True), default="",
                   help="comma-separated prompt lengths for the passkey test, e.g. 1024,4096 (default: off)")
    p.add_argument("--passkey-depths", type=T.float_list(0, 1), default="0.1,0.5,0.9", help="needle depths in [0,1] (default 0.1,0.5,0.9)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")
    p.add_argument("--threads", type=T.THREADS, default=None, help="torch CPU threads, 1..1024 (default: torch's choice)")
    add_device_option(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--out", type=T.out_file(), default=None, help="also write the JSON to this file")
    p.add_argument("--plot", type=T.out_file(PLOT_SUFFIXES), default=None, metavar="FILE.png",
                   help="plot Δppl vs effective bits (.png, .svg or .pdf)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    from lessmem.eval.generate_cli import add_offload_arguments

    add_offload_arguments(p)


def expand_kv(spec: str | None, full: bool = False) -> list[str]:
    """``--kv`` value -> config names (``presets``/``peers`` expand; unknown names fail later);
    None: the quick presets, or the main ones with ``full``."""
    from lessmem.eval.caches import available_peers, lessmem_presets

    if spec is None:
        presets = lessmem_presets()
        return [p for p in (MAIN_PRESETS if full else QUICK_PRESETS) if p in presets] or list(presets)
    names: list[str] = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        if part == "presets":
            names += list(lessmem_presets())
        elif part == "peers":
            names += available_peers()
        else:
            names.append(part)
    if not names:
        raise T.OptionError("--kv", spec, "names no config; allowed: preset names, peers, 'presets', 'peers'")
    return list(dict.fromkeys(names))


def offload_configs(args, specs: list) -> list:
    """With --offload: every lessmem config tiered (the shared ``generate_cli.offload_spec``),
    others unchanged; ValueError when no config can be tiered or --kv-budget lacks --offload."""
    from lessmem.eval.generate_cli import offload_spec

    if args.offload is None:
        return [offload_spec(args, s) for s in specs]  # --kv-budget alone -> ValueError
    if not any(s.kind == "lessmem" for s in specs):
        raise ValueError(f"--offload needs a lessmem preset in --kv, got {', '.join(s.name for s in specs)}; "
                         "allowed: the names `lessmem presets` lists")
    return [offload_spec(args, s) if s.kind == "lessmem" else s for s in specs]


def print_offload(rows: list[dict]) -> None:
    """After the table: where each tiered config's bytes were (``generate_cli.placement_lines``)."""
    from lessmem.eval.generate_cli import placement_lines

    tiered = [r for r in rows if "offload" in r]
    if tiered:
        d = tiered[0]["detail"] or {}
        print(f"offload {d.get('offload')}, {d.get('block_tokens')} tokens per block, prefetch "
              f"{'on' if d.get('prefetch') else 'off'} (mean over windows, peak = the highest):")
    for r in tiered:
        for line in placement_lines(r["offload"]):
            print(f"  {r['config']:<10} {line}")


def check(args) -> None:
    """Everything checked before the model loads: configs, tiers, lengths against the context."""
    from lessmem.eval.caches import resolve_configs

    full = getattr(args, "full", False)
    windows, window_len = FULL_PROTOCOL if full else QUICK_PROTOCOL
    args.windows = windows if args.windows is None else args.windows
    args.window_len = window_len if args.window_len is None else args.window_len
    if args.chunk > args.window_len:
        raise T.OptionError("--chunk", args.chunk, f"allowed: at most --window-len ({args.window_len})")
    names = expand_kv(args.kv, full)
    try:
        specs = resolve_configs(names)
    except ValueError as exc:
        raise T.OptionError("--kv", args.kv, str(exc)) from None
    args.names, args.configs = names, offload_configs(args, specs)  # unknown names fail here
    check_model(args.model)
    shape = peek_model(args.model)
    check_lengths(args, shape and shape["context"])


def check_lengths(args, context: int | None) -> None:
    """--window-len and --passkey lengths within the model's context (None: not known yet)."""
    from lessmem.eval.generate_cli import check_context

    check_context("--window-len", args.window_len, args.window_len, context, f"{args.window_len:,} tokens per window")
    for n in args.passkey:
        check_context("--passkey", ",".join(map(str, args.passkey)), n, context, f"a passkey prompt of {n:,} tokens")


def check_passkey(args, tok) -> None:
    """Each --passkey length holds a passkey prompt with this tokenizer (checked before the
    perplexity runs, not after)."""
    from lessmem.eval.passkey import passkey_prompt

    for n in args.passkey:
        try:
            passkey_prompt(tok, n, 0.5, 10_000)
        except ValueError as exc:
            raise T.OptionError("--passkey", ",".join(map(str, args.passkey)), str(exc)) from None


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        publish(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(args) -> int:
    import torch

    from lessmem.base.corpus import load_text
    from lessmem.eval.generate_cli import load_model, set_threads
    from lessmem.eval.perplexity import evaluate

    if not hasattr(args, "configs"):
        check(args)
    names, configs, lengths, depths = args.names, args.configs, args.passkey, args.passkey_depths
    from lessmem.eval.report import Progress, dumps, plot, print_table, quiet_transformers

    prog = Progress(not args.no_progress)
    quiet_transformers()
    set_threads(args.threads)
    text_name, text = load_text(args.text)
    prog.say(f"loading {args.model} ...")
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), weights=args.weights)
    to_device(model, args)
    check_lengths(args, getattr(model.config, "max_position_embeddings", None))
    check_passkey(args, tok)
    others = ", ".join(s.name for s in configs if s.kind != "baseline") or "nothing"
    prog.say(f"{others} vs the DynamicCache baseline, {args.windows} x {args.window_len} "
             f"tokens of {text_name}" + ("" if getattr(args, "full", False) or args.kv else "; the full table: --full"))
    with prog.steps("perplexity"):
        rows = evaluate(model, tok, configs, text, args.windows, args.window_len, args.chunk,
                        progress=prog, log=prog.say, model_name=str(args.model), text_name=text_name)
    pk = None
    if lengths:
        from lessmem.eval.passkey import passkey_eval

        prog.say(f"passkey: lengths {','.join(map(str, lengths))} x {len(depths)} depths")
        with prog.steps("passkey"):
            # in-memory caches: the tiered ones are bit-exact, and passkey does not close caches
            pk = passkey_eval(model, tok, names, lengths, depths, progress=prog)
    prog.say("done")

    js = dumps(rows, pk)
    if args.out:
        write_atomic(args.out, js + "\n")
    if args.json:
        sys.stdout.write(js + "\n")
    else:
        print_table(rows, pk)
        print_offload(rows)
    if args.plot:
        path = plot(rows, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:  # python -m lessmem.eval.cli
    from lessmem.cli import main as lessmem_main

    return lessmem_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())

