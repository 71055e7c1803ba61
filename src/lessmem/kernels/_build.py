"""Build-and-cache for the small C++ CPU kernels (torch.utils.cpp_extension).

``load_cpp(name, source)`` compiles ``source`` once per (source, torch version) into
``$LESSMEM_CACHE/kernels/<name>-<hash>`` and returns the module, or ``None`` (with a
warning, once) when no compiler or ninja is available, so callers fall back to torch.
Set ``LESSMEM_NO_CPP=1`` to force the fallback.

Example:
    >>> from lessmem.kernels._build import load_cpp
    >>> src = "int64_t twice(int64_t x) { return 2 * x; }"
    >>> mod = load_cpp("doc_twice", src, functions=["twice"])
    >>> mod is None or mod.twice(21) == 42
    True
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings

_LOCK = threading.Lock()
_MODULES: dict[str, object] = {}
# (name, source, flags) -> module: callers ask on every forward, so the answer must not
# cost a sha256 of the source each time (Python caches the hash of a str).
_LOADED: dict[tuple, object] = {}
_MISSING = object()


def load_cpp(name: str, source: str, functions: list[str], extra_cflags: list[str] | None = None,
             extra_ldflags: list[str] | None = None):
    if os.environ.get("LESSMEM_NO_CPP") == "1":
        return None
    fast_key = (name, source, tuple(extra_cflags or ()), tuple(extra_ldflags or ()))
    mod = _LOADED.get(fast_key, _MISSING)
    if mod is not _MISSING:
        return mod
    mod = _load(name, source, functions, extra_cflags, extra_ldflags)
    _LOADED[fast_key] = mod
    return mod


def _load(name: str, source: str, functions: list[str], extra_cflags: list[str] | None,
          extra_ldflags: list[str] | None = None):
    import torch

    key = hashlib.sha256((source + torch.__version__ + str(extra_cflags) + str(extra_ldflags or "")
                          ).encode()).hexdigest()[:12]
    full = f"{name}_{key}"
    with _LOCK:
        if full in _MODULES:
            return _MODULES[full]
        try:
            from torch.utils.cpp_extension import load_inline

            from ..base.paths import cache_dir

            flags = ["-O3", "-march=native", "-fopenmp", *(extra_cflags or [])]
            mod = load_inline(
                name=full,
                cpp_sources=[source],
                functions=functions,
                extra_cflags=flags,
                extra_ldflags=["-fopenmp", *(extra_ldflags or [])],
                build_directory=str(cache_dir("kernels", full)),
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, or a build error: fall back
            warnings.warn(
                f"lessmem: could not build the C++ kernel {name!r} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); using the slower torch path",
                RuntimeWarning,
                stacklevel=2,
            )
            mod = None
        _MODULES[full] = mod
        return mod
