"""Build-and-cache for the small C++ CPU kernels (torch.utils.cpp_extension).

The C++ lives in ``.cpp`` files shipped with the package (``kernels/csrc/*.cpp``, listed as
package data in ``pyproject.toml``). ``load_cpp_file(name, filename, functions)`` reads one
and hands it to ``load_cpp``; another package can keep its own ``csrc/`` folder and pass
``package=`` (e.g. ``load_cpp_file(..., package="lessmem.offload")`` reads
``lessmem/offload/csrc/<filename>``).

``load_cpp(name, source)`` compiles ``source`` once per (source, torch version, flags, host
CPU model and features) into
``$LESSMEM_CACHE/kernels/<name>-<hash>`` and returns the module, or ``None`` (with a
warning, once) when no compiler or ninja is available, so callers fall back to torch.
The hash is taken over the source text itself (``build_key``), so editing a ``.cpp`` file
rebuilds it. Set ``LESSMEM_NO_CPP=1`` to force the fallback.

Example:
    >>> from lessmem.kernels._build import load_cpp
    >>> src = "int64_t twice(int64_t x) { return 2 * x; }"
    >>> mod = load_cpp("doc_twice", src, functions=["twice"])
    >>> mod is None or mod.twice(21) == 42
    True
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from importlib import resources

CHECK_HEADER = "lm_check.h"  # prepended to every source: LM_CHECK / LM_CHECK_VALUE
_LOCK = threading.Lock()
_MODULES: dict[str, object] = {}
# (name, source, flags) -> module: callers ask on every forward, so the answer must not
# cost a sha256 of the source each time (Python caches the hash of a str).
_LOADED: dict[tuple, object] = {}
_MISSING = object()
# (name, file, package, functions, flags) -> module: load_cpp_file's answer without building
# the source text again (a prepended header makes it a new, unhashed string each time)
_FILES: dict[tuple, object] = {}


@functools.lru_cache(maxsize=None)
def cpp_source(filename: str, package: str = "lessmem.kernels") -> str:
    """The text of ``<package>/csrc/<filename>`` (read once per process).

    Raises ``FileNotFoundError`` naming the file when the package was installed without
    its C++ sources (see ``[tool.setuptools.package-data]`` in ``pyproject.toml``)."""
    path = resources.files(package).joinpath("csrc", filename)
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise FileNotFoundError(f"C++ source {filename!r} not found in {package}/csrc "
                                "(installed without its package data?)") from exc


@functools.cache
def cpu_capability() -> dict:
    """torch's report of this CPU's instruction sets (``amx_bf16``, ``avx512_bf16``, ...), read
    once per process (it costs ~10 µs a call, and kernels ask before every prompt chunk's
    attention); empty where this torch has no such report."""
    try:
        import torch

        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):
        return {}


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux's
    ``/proc/cpuinfo``), else the platform's machine and processor names. Part of every
    build key, so a cache directory shared by machines with other CPUs (an NFS home, a
    container image built elsewhere) never loads a binary using instructions this CPU lacks."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = {}
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part"):
                    info.setdefault(key, value.strip())
                elif not line.strip() and info:
                    break  # the first processor's block is enough: the others are the same CPU
        if info:
            return " | ".join(f"{k}: {v}" for k, v in sorted(info.items()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build_key(source: str, extra_cflags: list[str] | None = None,
              extra_ldflags: list[str] | None = None) -> str:
    """12 hex digits naming one build: changes with the source, torch version, flags and the
    host CPU (``host_cpu``: the build uses ``-march=native``)."""
    import torch

    text = source + torch.__version__ + str(extra_cflags) + str(extra_ldflags or "") + host_cpu()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_cpp_file(name: str, filename: str, functions: list[str],
                  extra_cflags: list[str] | None = None, extra_ldflags: list[str] | None = None,
                  package: str = "lessmem.kernels"):
    """``load_cpp`` on the source file ``<package>/csrc/<filename>``; ``None`` (with one
    warning) when the file is missing, as when no compiler is available."""
    if os.environ.get("LESSMEM_NO_CPP") == "1":
        return None
    key = (name, filename, package, tuple(functions), tuple(extra_cflags or ()), tuple(extra_ldflags or ()))
    mod = _FILES.get(key, _MISSING)
    if mod is not _MISSING:  # kernels ask on every call (30 layers a decode step): no string work
        return mod
    try:
        # the argument-check macros first (csrc/lm_check.h says why), then the file, its
        # line numbers kept for compiler messages
        source = (cpp_source(CHECK_HEADER) + f'\n#line 1 "{filename}"\n'
                  + cpp_source(filename, package))
    except FileNotFoundError as exc:
        if os.environ.get("LESSMEM_NO_CPP") != "1" and (package, filename) not in _NO_FILE:
            _NO_FILE.add((package, filename))
            _warn(name, exc)
        return None
    mod = _FILES[key] = load_cpp(name, source, functions, extra_cflags, extra_ldflags)
    return mod


def load_cpp(name: str, source: str, functions: list[str], extra_cflags: list[str] | None = None,
             extra_ldflags: list[str] | None = None):
    """The compiled module of ``source`` exporting ``functions``, or ``None`` when it cannot
    be built (or ``LESSMEM_NO_CPP=1``); built at most once per process and cached on disk."""
    if os.environ.get("LESSMEM_NO_CPP") == "1":
        return None
    fast_key = (name, source, tuple(extra_cflags or ()), tuple(extra_ldflags or ()))
    mod = _LOADED.get(fast_key, _MISSING)
    if mod is not _MISSING:
        return mod
    mod = _load(name, source, functions, extra_cflags, extra_ldflags)
    _LOADED[fast_key] = mod
    return mod


_NO_FILE: set[tuple[str, str]] = set()  # (package, filename) already warned about


def _warn(name: str, exc: BaseException) -> None:
    text = str(exc).splitlines()[0] if str(exc) else ""
    warnings.warn(f"lessmem: could not build the C++ kernel {name!r} ({type(exc).__name__}: "
                  f"{text}); using the slower torch path", RuntimeWarning, stacklevel=4)


def _load(name: str, source: str, functions: list[str], extra_cflags: list[str] | None,
          extra_ldflags: list[str] | None = None):
    full = f"{name}_{build_key(source, extra_cflags, extra_ldflags)}"
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
            _warn(name, exc)  # once per build: _MODULES remembers the failure
            mod = None
        _MODULES[full] = mod
        return mod
