"""One rich Console factory: piped output gets wide tables instead of rich's 80 columns."""

from __future__ import annotations

import sys


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200  # a pipe or file: don't cut columns
    return Console(stderr=stderr, width=width, highlight=False)
