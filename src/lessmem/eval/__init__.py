"""Evaluation: perplexity, KLD, retrieval, error tables, memory and speed.

Import-light: nothing heavy is imported until a name is used.

Example:
    >>> import lessmem.eval as ev
    >>> callable(ev.evaluate)
    True
"""

from __future__ import annotations

from lessmem.base.lazy import lazy_exports

_LAZY = {
    "evaluate": "lessmem.eval.perplexity",
    "make_windows": "lessmem.eval.perplexity",
    "check_protocol": "lessmem.eval.perplexity",
    "load_text": "lessmem.base.corpus",
    "CacheSpec": "lessmem.eval.caches",
    "resolve_configs": "lessmem.eval.caches",
    "measure_memory": "lessmem.eval.caches",
    "available_peers": "lessmem.eval.caches",
    "memory_at_length": "lessmem.eval.caches",
    "passkey_prompt": "lessmem.eval.passkey",
    "passkey_eval": "lessmem.eval.passkey",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
