"""``lessmem eval``: perplexity, KLD, top-1, bytes, speed (and passkey) per KV cache config.

With no arguments: the built-in model on the built-in text (Python's docs), the
unquantized ``DynamicCache`` against the main lessmem presets.

Example:
    $ lessmem eval                                   # the README's main job
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

import sys
from pathlib import Path

HELP = "measure perplexity, KLD, retrieval, bytes and speed of KV caches"

MAIN_PRESETS = ("fp8", "int8", "int4", "kivi-4", "kivi-2", "best-4", "best-2")
DEFAULT_WINDOWS = 2
DEFAULT_WINDOW_LEN = 1024
DEFAULT_CHUNK = 16
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in alias, .gguf file, HF directory or hub id (default: smollm2-135m)")
    p.add_argument("--text", default="pydoc",
                   help="pydoc (built-in: Python's docs), wikitext2, or a text FILE (default: pydoc)")
    p.add_argument("--kv", default=None,
                   help="comma-separated configs: lessmem presets, peers (quanto-int4, quanto-int2, "
                        "hqq-int4, hf-fp8), 'presets' (all lessmem presets), 'peers' (all installed "
                        f"peers); default: {','.join(MAIN_PRESETS)}. DynamicCache is always the baseline")
    p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS, help=f"number of windows (default {DEFAULT_WINDOWS})")
    p.add_argument("--window-len", type=int, default=DEFAULT_WINDOW_LEN,
                   help=f"tokens per window; the first quarter is prefilled (default {DEFAULT_WINDOW_LEN})")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                   help=f"tokens per decode step after the prefill; 1 = exact decoding (default {DEFAULT_CHUNK})")
    p.add_argument("--passkey", default="",
                   help="comma-separated prompt lengths for the passkey test, e.g. 1024,4096 (default: off)")
    p.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="needle depths in [0,1] (default 0.1,0.5,0.9)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="plot Δppl vs effective bits")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from lessmem.eval.generate_cli import add_offload_arguments

    add_offload_arguments(p)


def _int_list(s: str, what: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={s!r}; allowed: comma-separated integers") from None


def _float_list(s: str, what: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={s!r}; allowed: comma-separated numbers") from None


def expand_kv(spec: str | None) -> list[str]:
    """``--kv`` value -> config names (``presets``/``peers`` expand; unknown names fail later)."""
    from lessmem.eval.caches import available_peers, lessmem_presets

    if spec is None:
        presets = lessmem_presets()
        return [p for p in MAIN_PRESETS if p in presets] or list(presets)
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
        raise ValueError(f"--kv {spec!r} names no config; allowed: preset names, peers, 'presets', 'peers'")
    return list(dict.fromkeys(names))


class _Progress:
    """A rich progress bar on stderr (or nothing)."""

    def __init__(self, enabled: bool, label: str):
        self.bar = self.task = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.label = label

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done, total=total)


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


def run(args) -> int:
    import torch

    from lessmem.eval.caches import resolve_configs
    from lessmem.eval.perplexity import check_protocol, evaluate
    from lessmem.base.corpus import load_text

    check_protocol(args.windows, args.window_len, args.chunk)
    names = expand_kv(args.kv)
    configs = offload_configs(args, resolve_configs(names))  # unknown names fail before the model loads
    lengths = _int_list(args.passkey, "--passkey")
    depths = _float_list(args.passkey_depths, "--passkey-depths")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads}; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    text_name, text = load_text(args.text)

    from lessmem.models import ModelFetchError, load

    try:
        model, tok = load(args.model, dtype=getattr(torch, args.dtype))
    except ModelFetchError as exc:
        raise ValueError(str(exc)) from exc
    show = not args.no_progress
    with _Progress(show, "perplexity") as prog:
        rows = evaluate(model, tok, configs, text, args.windows, args.window_len, args.chunk,
                        progress=prog, model_name=str(args.model), text_name=text_name)
    pk = None
    if lengths:
        from lessmem.eval.passkey import passkey_eval

        with _Progress(show, "passkey") as prog:
            # in-memory caches: the tiered ones are bit-exact, and passkey does not close caches
            pk = passkey_eval(model, tok, names, lengths, depths, progress=prog)

    from lessmem.eval.report import dumps, plot, print_table

    js = dumps(rows, pk)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(js + "\n")
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

