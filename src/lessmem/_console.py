"""The command line's output helpers: one rich Console factory (piped output gets wide
tables instead of rich's 80 columns), and publishing a finished output file or folder."""

from __future__ import annotations

import sys


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200  # a pipe or file: don't cut columns
    return Console(stderr=stderr, width=width, highlight=False)


def publish(tmp, out) -> None:
    """Rename a finished temporary file or folder ``tmp`` to ``out`` (a run that fails
    before this leaves no partial output), with the modes a plain write would have given:
    ``mkstemp``/``mkdtemp`` make them 0600/0700."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, (0o777 if os.path.isdir(tmp) else 0o666) & ~mask)
    os.replace(tmp, out)
