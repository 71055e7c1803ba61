"""Lazy public names for a package: resolved from their module on first attribute access."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, names: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package`` exporting ``names`` (name -> module)."""

    def __getattr__(name: str):
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        setattr(sys.modules[package], name, value)  # resolve once
        return value

    def __dir__():
        return sorted(getattr(sys.modules[package], "__all__", names))

    return __getattr__, __dir__
