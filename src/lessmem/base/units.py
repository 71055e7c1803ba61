"""Units: parse "4GiB", "25GB/s", "16k"; print bytes so GiB and GB cannot be confused.

One rule for every size lessmem reads (``--kv-budget``, ``--offload host@1GiB``,
``--host-ram``, ``device_budget=``...), whichever command parses it:

- ``KiB MiB GiB TiB PiB`` (and ``Ki Mi Gi Ti Pi``) are binary: powers of 1024;
- ``KB MB GB TB PB`` are decimal: powers of 1000 (how vendors quote bandwidth and disks);
- a bare prefix ``K M G T P`` is binary, as ``free``, docker (``--memory 2g``) and most
  command-line tools mean it: ``2G`` = ``2GiB`` = 2,147,483,648 bytes;
- ``B`` or no unit is bytes; prefixes and ``B`` are case-insensitive (``b`` is a byte,
  never a bit); a number may have a fraction or an exponent (``1.5GiB``, ``1e9``).

Rates (``parse_rate``) use the same rule with a trailing ``/s`` (``25GB/s`` = 25·10^9 B/s).

Example:
    >>> from lessmem.base.units import parse_bytes, parse_rate, fmt_bytes
    >>> parse_bytes("4GiB"), parse_bytes("4G"), parse_bytes("4GB"), parse_rate("25GB/s")
    (4294967296, 4294967296, 4000000000, 25000000000.0)
    >>> fmt_bytes(4 * 2**30)
    '4.00 GiB (4.29 GB)'
"""

from __future__ import annotations

import math
import re

BINARY = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}
DECIMAL = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
_BINARY_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))  # largest first

_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.I)


UNITS_HELP = ("B, KB/MB/GB/TB (1000-based), KiB/MiB/GiB/TiB (1024-based), "
              "or a bare K/M/G/T (1024-based)")


def _parse(text, what: str, allow_unitless: bool = True) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{what}={text!r} is not a size; allowed: a number with an optional unit: {UNITS_HELP}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError(
                f"{what}={text!r} is not a size; use a number with an optional unit "
                f"such as 4GiB, 512MiB, 16GB, 2G, 1e9; allowed units: {UNITS_HELP}"
            )
        num, prefix, binary, b = m.groups()
        if not allow_unitless and not (prefix or b):
            raise ValueError(f"{what}={text!r} needs a unit, e.g. 25GB/s")
        if binary and not prefix:
            raise ValueError(f"{what}={text!r}: 'i' needs a prefix (KiB, MiB, GiB, TiB); allowed units: {UNITS_HELP}")
        # KB (prefix + B, no i) is decimal; KiB, Ki and a bare K are binary
        decimal = bool(prefix) and bool(b) and not binary
        value = float(num) * (DECIMAL if decimal else BINARY)[prefix.lower()]
    if not math.isfinite(value):
        raise ValueError(f"{what}={text!r} must be finite")
    return value


def parse_bytes(text, what: str = "size") -> int:
    """Bytes from ``"4GiB"``, ``"16GB"``, ``"2G"``, ``"512MiB"``, ``"1e9"`` or a number (>= 0),
    by the module's one rule: ``KB`` 1000-based, ``KiB`` and a bare ``K`` 1024-based.

    Example:
        >>> parse_bytes("64MiB"), parse_bytes("64M"), parse_bytes("64MB"), parse_bytes("1.5 GiB")
        (67108864, 67108864, 64000000, 1610612736)
    """
    v = _parse(text, what)
    if v < 0:
        raise ValueError(f"{what}={text!r} must not be negative")
    return int(round(v))


def parse_rate(text, what: str = "bandwidth") -> float:
    """Bytes/s from ``"25GB/s"``, ``"3.35TB/s"``, ``"1600KiB/s"`` (a trailing /s is optional)."""
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    elif s.lower().endswith("ps"):
        s = s[:-2]
    v = _parse(s, what)
    if v <= 0:
        raise ValueError(f"{what}={text!r} must be positive")
    return v


def parse_count(text, what: str = "count") -> int:
    """An integer count with optional k/m suffix (decimal or 1024-based: ``16k`` = 16,384 tokens)."""
    s = str(text).strip().lower().replace(",", "").replace("_", "")
    m = re.fullmatch(r"(-?[0-9]*\.?[0-9]+)\s*([km]?)", s)
    if not m:
        raise ValueError(f"{what}={text!r} is not a whole number (e.g. 16384 or 16k = 16,384)")
    # token counts are binary: "16K context" means 16,384 tokens
    v = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2)]
    if v != int(v):
        raise ValueError(f"{what}={text!r} is not a whole number")
    return int(v)


def fmt_bytes(n: float, both: bool = True) -> str:
    """Binary units, with the decimal value beside them (``both``) so nobody confuses the two."""
    n = float(n)
    if n < KiB:
        return f"{n:,.0f} B"
    for unit, div in _BINARY_UNITS:
        if n >= div:
            binary = f"{n / div:,.2f} {unit}"
            break
    if not both:
        return binary
    for unit, div in (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= div:
            return f"{binary} ({n / div:,.2f} {unit})"
    return binary


def size_text(n: int) -> str:
    """Bytes as the largest exact binary unit: ``size_text(3 * 2**30) == "3GiB"``, ``"1000B"``
    (no space, so ``parse_bytes`` and ``--offload host@3GiB`` read it back exactly)."""
    for unit, div in _BINARY_UNITS:
        if n and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def fmt_rate(bps: float) -> str:
    """Bandwidth in decimal units (how vendors quote it), plus GiB/s or MiB/s."""
    for unit, div in (("TB/s", TB), ("GB/s", GB), ("MB/s", MB), ("KB/s", KB)):
        if bps >= div:
            dec = f"{bps / div:,.4g} {unit}"
            break
    else:
        dec = f"{bps:,.0f} B/s"
    for unit, div in (("GiB/s", GiB), ("MiB/s", MiB), ("KiB/s", KiB)):
        if bps >= div:
            return f"{dec} ({bps / div:,.4g} {unit})"
    return dec


def fmt_time(s: float) -> str:
    if s == math.inf:
        return "inf"
    if s >= 1:
        return f"{s:,.3g} s"
    if s >= 1e-3:  # 2.86 ms, 171.8 ms, 859.0 ms (four significant digits)
        ms = s * 1e3
        return f"{ms:,.2f} ms" if ms < 10 else f"{ms:,.1f} ms"
    return f"{s * 1e6:,.1f} µs"
