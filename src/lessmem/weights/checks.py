"""Argument checks shared by the weight configs and the passes that take the same arguments."""

from __future__ import annotations


def _check_int(name: str, owner: str, v, lo: int, hi: int | None = None):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{owner} {name}={v!r} must be an integer {rng}")


def _check_bool(name: str, owner: str, v):
    if not isinstance(v, bool):
        raise ValueError(f"{owner} {name}={v!r} must be True or False")
