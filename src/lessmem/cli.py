"""The ``lessmem`` command: a thin dispatcher to one module per subcommand.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)``,
optionally ``check(args)`` (every check that needs no work, raising ValueError) and
``run(args) -> int``. Modules are imported only when their command runs, so
``lessmem --help`` stays fast.

Example:
    $ lessmem plan --model llama-3-8b --context 16384 --batch 16 --kv fp16,fp8,int4
"""

from __future__ import annotations

import importlib
import linecache
import os
import sys
from pathlib import Path

import lessmem
from lessmem._cli_types import Parser, fail

# command -> (module, one-line help). The help is duplicated here so that
# `lessmem --help` does not import every layer.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("lessmem.plan.cli", "memory, bandwidth and tier splits on paper"),
    "explore": ("lessmem.eval.explore_cli", "quantization error explorer (bits x group size)"),
    "eval": ("lessmem.eval.cli", "measure perplexity, KLD, retrieval, bytes and speed of KV caches"),
    "generate": ("lessmem.eval.generate_cli", "generate text with a quantized KV cache"),
    "quantize": ("lessmem.weights.cli", "quantize a model's weights (RTN, GPTQ, AWQ, SmoothQuant, GGUF)"),
    "presets": ("lessmem.presets_cli", "list the named KV-cache presets"),
    "kv-allocate": ("lessmem.eval.allocate_cli", "per-layer KV bits from measured sensitivity, under a "
                    "bits budget (writes a --kv file)"),
    "serve": ("lessmem.serve.cli", "serve a model over an OpenAI-compatible HTTP API"),
}
_PACKAGE = Path(lessmem.__file__).resolve().parent


def build_parser(only: str | None = None) -> Parser:
    parser = Parser(
        prog="lessmem",
        description="Make LLMs fit in less memory: quantization, KV cache, offload, planning.",
    )
    parser.add_argument("--version", action="version", version=f"lessmem {lessmem.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == only:
            importlib.import_module(module).add_arguments(p)
    return parser


def _raised_by_lessmem(exc: BaseException) -> bool:
    """True when ``exc`` came from a ``raise`` statement in lessmem's own code (a check that
    names what is allowed), not from an operation failing somewhere (a bug to show in full)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    line = linecache.getline(str(path), tb.tb_lineno).strip()
    return path.is_relative_to(_PACKAGE) and line.startswith("raise")


SPIN_COMMANDS = ("serve",)


def _spin_between_ops() -> None:
    """Give the OpenMP runtime back its default wait policy (spin a while, then sleep)
    when it was lessmem's import that set a short spin, before torch starts: a server
    is the one busy process of its machine, and its compute thread runs thousands of small
    ops a step, each of which would otherwise wake sleeping threads."""
    if lessmem.OMP_POLICY_FROM_LESSMEM and "torch" not in sys.modules:
        for name in lessmem.SPIN_SETTINGS:
            os.environ.pop(name, None)


def main(argv: list[str] | None = None) -> int:
    """Parse, check every option (``check(args)`` of the subcommand), then run.

    Bad input of any kind ends as one line ``lessmem CMD: error: ...`` on stderr and exit
    code 2, before anything is loaded or written; ``LESSMEM_DEBUG=1`` shows the traceback.
    A ValueError or TypeError counts as bad input when a lessmem check raised it (a
    ``raise`` in lessmem's code, which says what is allowed); one from deeper down (numpy,
    torch, a plain ``int("x")``) is a check missing in lessmem and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in COMMANDS else None
    if only in SPIN_COMMANDS:
        _spin_between_ops()  # before the subcommand's module imports torch
    parser = build_parser(only)
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a one-line argparse error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        if extra:
            return fail("lessmem", f"unrecognized arguments: {' '.join(extra)}; allowed: see lessmem --help")
        parser.print_help()
        return 0
    prog = f"lessmem {args.command}"
    if extra:
        return fail(prog, f"unrecognized arguments: {' '.join(extra)}; allowed: see {prog} --help")
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        if hasattr(module, "check"):
            module.check(args)  # everything that can be checked before work starts
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("LESSMEM_DEBUG"):
            raise
        if isinstance(exc, FileNotFoundError) or (
                isinstance(exc, (ValueError, TypeError)) and _raised_by_lessmem(exc)):
            return fail(prog, exc)  # bad input, named by the check that found it
        if isinstance(exc, OSError) or type(exc).__name__ == "ModelFetchError":
            return fail(prog, exc, 1)  # the machine, not the input: a full disk, no network
        raise  # a bug: the whole traceback


if __name__ == "__main__":
    raise SystemExit(main())
