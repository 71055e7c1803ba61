"""Units: parse "4GiB", "25GB/s", "16k"; print bytes so GiB and GB cannot be confused.

Binary prefixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB,
TB) powers of 1000, as the lecture defines them (1 KiB = 1,024 bytes) and as vendors
quote bandwidth (1 GB/s = 10^9 bytes/s). A bare number is bytes (or tokens).

Example:
    >>> from lessmem.plan.units import parse_bytes, parse_rate, fmt_bytes
    >>> parse_bytes("4GiB"), parse_rate("25GB/s")
    (4294967296, 25000000000.0)
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

_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.I)


def _parse(text: str, what: str, allow_unitless: bool = True) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError(
                f"{what}={text!r} is not a size; use a number with an optional unit "
                "such as 4GiB, 512MiB, 16GB, 1e9 (KiB/MiB/GiB = 1024-based, KB/MB/GB = 1000-based)"
            )
        num, prefix, binary, b = m.groups()
        if not allow_unitless and not (prefix or b):
            raise ValueError(f"{what}={text!r} needs a unit, e.g. 25GB/s")
        if binary and not prefix:
            raise ValueError(f"{what}={text!r}: 'i' needs a prefix (KiB, MiB, GiB, TiB)")
        value = float(num) * (BINARY if binary else DECIMAL)[prefix.lower()]
    if not math.isfinite(value):
        raise ValueError(f"{what}={text!r} must be finite")
    return value


def parse_bytes(text, what: str = "size") -> int:
    """Bytes from ``"4GiB"``, ``"16GB"``, ``"512MiB"``, ``"1e9"`` or a number; must be >= 0."""
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
    # token counts follow the lecture: "16K context" means 16,384 tokens
    v = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2)]
    if v != int(v):
        raise ValueError(f"{what}={text!r} is not a whole number")
    return int(v)


def fmt_bytes(n: float, both: bool = True) -> str:
    """Binary units, with the decimal value beside them (``both``) so nobody confuses the two."""
    n = float(n)
    if n < KiB:
        return f"{n:,.0f} B"
    for unit, div in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            binary = f"{n / div:,.2f} {unit}"
            break
    if not both:
        return binary
    for unit, div in (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= div:
            return f"{binary} ({n / div:,.2f} {unit})"
    return binary


def fmt_rate(bps: float) -> str:
    """Bandwidth in decimal units (how vendors and the lecture quote it), plus GiB/s or MiB/s."""
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
    if s >= 1e-3:  # 2.86 ms, 171.8 ms, 859.0 ms (the lecture's precision)
        ms = s * 1e3
        return f"{ms:,.2f} ms" if ms < 10 else f"{ms:,.1f} ms"
    return f"{s * 1e6:,.1f} µs"
