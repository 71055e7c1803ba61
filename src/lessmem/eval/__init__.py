"""Evaluation: perplexity, KLD, retrieval, error tables, memory and speed.

Import-light: nothing heavy is imported until a name is used.

Example:
    >>> import lessmem.eval as ev
    >>> callable(ev.evaluate)
    True
"""

from __future__ import annotations

import importlib

_LAZY = {
    "evaluate": "lessmem.eval.perplexity",
    "make_windows": "lessmem.eval.perplexity",
    "check_protocol": "lessmem.eval.perplexity",
    "load_text": "lessmem.eval.text",
    "CacheSpec": "lessmem.eval.caches",
    "resolve_configs": "lessmem.eval.caches",
    "measure_memory": "lessmem.eval.caches",
    "available_peers": "lessmem.eval.caches",
    "memory_at_length": "lessmem.eval.caches",
    "passkey_prompt": "lessmem.eval.passkey",
    "passkey_eval": "lessmem.eval.passkey",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'lessmem.eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
