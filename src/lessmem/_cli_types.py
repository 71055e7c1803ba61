"""Argument checks shared by every ``lessmem`` subcommand: bad input fails before any work.

Each factory here returns an argparse ``type=`` function. It parses one option's text
and raises ``argparse.ArgumentTypeError`` saying what is allowed; :class:`Parser` turns
that into ONE line on stderr and exit code 2::

    lessmem eval: error: --threads 1.5: allowed: an integer in [1, 1024]

:class:`Parser` also prints argparse's own errors (unknown option, missing value, bad
choice) as one line, without the usage block. Checks that need more than one option, or
the model's config, live in each subcommand's ``check(args)`` and raise
:class:`OptionError` (a ``ValueError``), which ``lessmem.cli`` prints the same way.

Example:
    >>> threads = integer(1, 1024)
    >>> threads("4")
    4
    >>> threads("1.5")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 1.5: allowed: an integer in [1, 1024]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

MAX_BYTES = 2**50  # 1 PiB: any memory size above this is a typo
MAX_RATE = 1e15  # 1 PB/s
MAX_TOKENS = 2**24  # 16M tokens: beyond any model's context


def show(value) -> str:
    """``value`` as it appears in an error: bare when plain, quoted when empty/odd, cut when long."""
    s = str(value)
    if len(s) > 60:
        s = s[:57] + "..."
    return s if s and s.isprintable() and not any(c.isspace() for c in s) else repr(s)


class OptionError(ValueError):
    """Bad option value found after parsing: ``OptionError("--out", value, "allowed: ...")``."""

    def __init__(self, option: str, value, allowed: str):
        super().__init__(f"{option}: {allowed}" if value is None else f"{option} {show(value)}: {allowed}")


def bad(value, allowed: str) -> argparse.ArgumentTypeError:
    """The error a type function raises: ``VALUE: allowed ...`` (the parser adds the option)."""
    return argparse.ArgumentTypeError(f"{show(value)}: {allowed}")


# how argparse's own messages after "argument --opt: " begin (ours begin with the value)
_ARGPARSE_WORDS = ("invalid ", "expected ", "not allowed with", "ignored explicit", "ambiguous option")
_INT = re.compile(r"[+-]?\d+")


def _range_text(kind: str, lo, hi) -> str:
    if hi is None:
        return f"{kind} >= {lo}" if lo is not None else kind
    return f"{kind} in [{lo}, {hi}]" if lo is not None else f"{kind} <= {hi}"


def _g(x: float) -> str:
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")


def _named(fn, name: str):
    fn.__name__ = name  # argparse names the type in some messages
    return fn


def integer(lo: int | None = None, hi: int | None = None):
    """Whole numbers in [lo, hi], written in decimal digits (no ``1.5``, ``1e3``, ``inf``)."""
    allowed = "allowed: " + _range_text("an integer", lo, hi)

    def parse(text: str) -> int:
        s = text.strip()
        if not _INT.fullmatch(s):
            raise bad(text, allowed)
        v = int(s)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(text, allowed)
        return v

    return _named(parse, "integer")


def number(lo: float, hi: float, lo_open: bool = False):
    """A finite number in [lo, hi] (``(lo, hi]`` with ``lo_open``); no inf, no nan."""
    allowed = f"allowed: a number in {'(' if lo_open else '['}{_g(lo)}, {_g(hi)}]"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise bad(text, allowed) from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise bad(text, allowed)
        return v

    return _named(parse, "number")


def int_choice(values: tuple[int, ...]):
    """One of the integers ``values``."""
    allowed = f"allowed: {', '.join(map(str, values))}"

    def parse(text: str) -> int:
        s = text.strip()
        if not _INT.fullmatch(s) or int(s) not in values:
            raise bad(text, allowed)
        return int(s)

    return _named(parse, "int_choice")


def choice(values: tuple[str, ...]):
    """One of the names ``values`` (case as given)."""
    allowed = f"allowed: {', '.join(values)}"

    def parse(text: str) -> str:
        if text not in values:
            raise bad(text, allowed)
        return text

    return _named(parse, "choice")


def apply(option: str, fn, value):
    """``fn(value)`` for a check made after parsing: its ArgumentTypeError as an OptionError."""
    try:
        return fn(value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{option} {exc}") from None


def int_list(lo: int, hi: int, empty_ok: bool = False):
    """Comma-separated integers, each in [lo, hi] (``""`` = none when ``empty_ok``)."""
    one = integer(lo, hi)
    allowed = f"allowed: comma-separated integers in [{lo}, {hi}]" + (", or nothing" if empty_ok else "")

    def parse(text: str) -> list[int]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts and not empty_ok:
            raise bad(text, allowed)
        try:
            return [one(p) for p in parts]
        except argparse.ArgumentTypeError:
            raise bad(text, allowed) from None

    return _named(parse, "int_list")


def float_list(lo: float, hi: float):
    """Comma-separated finite numbers in [lo, hi], at least one."""
    one = number(lo, hi)
    allowed = f"allowed: comma-separated numbers in [{_g(lo)}, {_g(hi)}]"

    def parse(text: str) -> list[float]:
        parts = [p for p in text.split(",") if p.strip()]
        try:
            if parts:
                return [one(p) for p in parts]
        except argparse.ArgumentTypeError:
            pass
        raise bad(text, allowed)

    return _named(parse, "float_list")


def choice_list(allowed_names, what: str = "names"):
    """Comma-separated names out of ``allowed_names``, at least one, duplicates dropped."""
    names = tuple(allowed_names)
    allowed = f"allowed: comma-separated {what} out of {', '.join(names)}"

    def parse(text: str) -> list[str]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or any(p not in names for p in parts):
            raise bad(text, allowed)
        return list(dict.fromkeys(parts))

    return _named(parse, "choice_list")


def size(lo: int = 1, hi: int = MAX_BYTES):
    """A byte size such as ``64MiB`` in [lo, hi]; returns the text (the library parses it again)."""
    allowed = (f"allowed: a size from {lo} B to 1 PiB such as 64MiB, 4GiB, 16GB "
               "(KB/MB/GB 1000-based; KiB/MiB/GiB and a bare K/M/G 1024-based)")

    def parse(text: str) -> str:
        from lessmem.base.units import parse_bytes

        try:
            v = parse_bytes(text)
        except (ValueError, OverflowError):
            raise bad(text, allowed) from None
        if not lo <= v <= hi:
            raise bad(text, allowed)
        return text

    return _named(parse, "size")


def rate():
    """A bandwidth such as ``25GB/s`` (positive, at most 1 PB/s); returns the text."""
    allowed = "allowed: a bandwidth up to 1 PB/s such as 25GB/s, 3.35TB/s, 1600KiB/s"

    def parse(text: str) -> str:
        from lessmem.base.units import parse_rate

        try:
            v = parse_rate(text)
        except (ValueError, OverflowError):
            raise bad(text, allowed) from None
        if v > MAX_RATE:
            raise bad(text, allowed)
        return text

    return _named(parse, "rate")


def count(lo: int = 1, hi: int = MAX_TOKENS):
    """A whole count with an optional k/m (1024-based: ``16k`` = 16,384); returns the text."""
    allowed = f"allowed: a whole number in [{lo:,}, {hi:,}], e.g. 16384 or 16k"

    def parse(text: str) -> str:
        from lessmem.base.units import parse_count

        try:
            v = parse_count(text)
        except (ValueError, OverflowError):
            raise bad(text, allowed) from None
        if not lo <= v <= hi:
            raise bad(text, allowed)
        return text

    return _named(parse, "count")


def nonempty_text(text: str) -> str:
    """Any text with something other than whitespace in it."""
    if not text.strip():
        raise bad(text, "allowed: non-empty text")
    return text


def _writable_dir_above(path: Path) -> str | None:
    """None when ``path`` could be created: its nearest existing ancestor is a writable
    directory; else what is wrong. Nothing is created."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is not a directory"
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"{parent} is not writable"
            return None
    return "no existing directory above it"


def out_file(suffixes: tuple[str, ...] = ()):
    """A file to write: not a directory, in a writable place, ending in one of ``suffixes``."""
    ends = f"ending in {' or '.join(suffixes)} " if suffixes else ""

    def parse(text: str) -> Path:
        p = Path(text).expanduser()
        allowed = f"allowed: a file path {ends}in a writable directory"
        if not text.strip():
            raise bad(text, allowed)
        if p.is_dir() or text.endswith(("/", os.sep)):
            raise bad(text, f"is a directory; {allowed}")
        if suffixes and p.suffix.lower() not in suffixes:
            raise bad(text, allowed)
        if p.exists() and not os.access(p, os.W_OK):
            raise bad(text, f"the file is not writable; {allowed}")
        why = _writable_dir_above(p)
        if why:
            raise bad(text, f"{why}; {allowed}")
        return p

    return _named(parse, "out_file")


def out_dir(text: str) -> Path:
    """A directory to write into: an existing directory or a path that can be created."""
    p = Path(text).expanduser()
    allowed = "allowed: a directory (existing, or one that can be created) in a writable place"
    if not text.strip() or (p.exists() and not p.is_dir()):
        raise bad(text, f"is a file; {allowed}" if text.strip() else allowed)
    if p.is_dir():
        why = None if os.access(p, os.W_OK | os.X_OK) else "not writable"
    else:
        why = _writable_dir_above(p)
    if why:
        raise bad(text, f"{why}; {allowed}")
    return p


def text_file(text: str) -> Path:
    """A readable, non-empty UTF-8 text file (no NUL bytes: not a binary file)."""
    p = Path(text).expanduser()
    if not p.is_file():
        raise bad(text, "allowed: an existing text file")
    why = text_file_problem(p)
    if why:
        raise bad(text, f"{why}; allowed: a non-empty UTF-8 text file")
    return p


def text_file_problem(p: Path) -> str | None:
    """What makes ``p`` unusable as text (empty, binary, not UTF-8), or None."""
    try:
        with open(p, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not head.strip():
        return "the file is empty"
    if b"\0" in head:
        return "a binary file (it holds NUL bytes)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the sample
            return f"not UTF-8 text (bad byte at offset {exc.start})"
    return None


def text_source(text: str) -> str:
    """A built-in text (``pydoc``, ``wikitext2``) or a text file; returns the text as given."""
    from lessmem.base.corpus import BUILTIN_TEXTS

    if text in BUILTIN_TEXTS:
        return text
    names, p = ", ".join(BUILTIN_TEXTS), Path(text).expanduser()
    why = f"neither {names} nor an existing file" if not p.is_file() else text_file_problem(p)
    if why:
        raise bad(text, f"{why}; allowed: {names} or a non-empty UTF-8 text file")
    return text


def offload_tiers(text: str) -> str:
    """An ``--offload`` tier list (``lessmem.base.tierspec``) whose disk paths can be created."""
    from lessmem.base.tierspec import parse_offload_spec

    try:
        specs = parse_offload_spec(text)
    except ValueError as exc:
        raise bad(text, str(exc)) from None
    for t in specs:
        if t.kind == "disk":
            d = Path(t.target).expanduser()
            why = ("not a directory" if d.exists() and not d.is_dir() else
                   None if d.is_dir() else _writable_dir_above(d))
            if why:
                raise bad(text, f"disk:{t.target}: {why}; allowed: a directory that exists or can be created")
    return text


THREADS = integer(1, 1024)  # torch CPU threads

_DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def device(text: str) -> str:
    """``--device``: ``auto`` (a CUDA device when there is one, else the CPU), ``cpu``,
    ``cuda`` or ``cuda:N``; a CUDA device this machine lacks is refused here, before any
    model loads."""
    value = text.strip().lower()
    if not _DEVICE.fullmatch(value):
        raise bad(text, "allowed: auto, cpu, cuda, cuda:N")
    if value.startswith("cuda"):
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= n:
            have = f"cuda:0..cuda:{n - 1}" if n else "no CUDA device here (torch.cuda.is_available() is False)"
            raise bad(text, f"{have}; allowed: auto, cpu" + (", cuda, cuda:N with N < " + str(n) if n else ""))
    return value


def resolve_device(value: str) -> str:
    """The torch device string for a checked ``--device`` value."""
    if value == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return value


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: error: --opt VALUE: allowed``."""

    def error(self, message: str):
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m:
            name = max(m.group(1).split("/"), key=len)
            message = self._reword(name, " ".join(m.group(2).split()))
        message = " ".join(message.split())
        if not any(w in message for w in ("allowed", "required", "needs")):
            message += f"; allowed: see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message}\n")

    @staticmethod
    def _reword(name: str, rest: str) -> str:
        """argparse's own phrases in this module's form: ``--opt VALUE: allowed ...``."""
        c = re.fullmatch(r"invalid choice: '(.*)' \(choose from (.*)\)", rest)
        if c:
            return f"{name} {show(c.group(1))}: allowed: {c.group(2).replace(chr(39), '')}"
        if rest.startswith("expected one argument"):
            return f"{name}: needs a value"
        e = re.fullmatch(r"ignored explicit argument '(.*)'", rest)
        if e:
            return f"{name}={show(e.group(1))}: allowed: {name} alone (a flag takes no value)"
        return f"{name}: {rest}" if rest.startswith(_ARGPARSE_WORDS) else f"{name} {rest}"


def fail(prog: str, message: str, code: int = 2) -> int:
    """Print ``PROG: error: MESSAGE`` as one line on stderr; return ``code``."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code
