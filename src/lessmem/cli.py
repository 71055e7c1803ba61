"""The ``lessmem`` command: a thin dispatcher to one module per subcommand.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so
``lessmem --help`` stays fast.

Example:
    $ lessmem plan --model llama-3-8b --context 16384 --batch 16 --kv fp16,fp8,int4
"""

from __future__ import annotations

import argparse
import importlib
import sys

import lessmem

# command -> (module, one-line help). The help is duplicated here so that
# `lessmem --help` does not import every layer.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("lessmem.plan.cli", "memory, bandwidth and tier splits on paper"),
    "explore": ("lessmem.eval.explore_cli", "quantization error explorer (bits x group size)"),
    "eval": ("lessmem.eval.cli", "measure perplexity, KLD, retrieval, bytes and speed of KV caches"),
    "generate": ("lessmem.eval.generate_cli", "generate text with a quantized KV cache"),
    "quantize": ("lessmem.weights.cli", "quantize a model's weights (RTN, GPTQ, AWQ, SmoothQuant, GGUF)"),
    "presets": ("lessmem.presets_cli", "list the named KV-cache presets"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lessmem",
        description="Make LLMs fit in less memory: quantization, KV cache, offload, planning.",
    )
    parser.add_argument("--version", action="version", version=f"lessmem {lessmem.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == only:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"lessmem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
