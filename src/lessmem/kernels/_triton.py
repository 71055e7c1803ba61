"""What every Triton module of lessmem shares: the optional import and two questions.

``triton`` / ``tl`` are None where triton (the ``gpu`` extra) is not installed, and ``jit``
then leaves kernel functions as plain Python (they are never launched: each module's
public functions check ``available()`` first). ``interpreting()`` says whether Triton runs
kernels under its interpreter (``TRITON_INTERPRET=1`` set before triton was imported: the
mode is fixed for the whole process then), where CPU tensors are allowed.
"""

from __future__ import annotations

try:  # triton is the optional 'gpu' extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None

jit = triton.jit if triton is not None else (lambda fn: fn)


def available() -> bool:
    """True when triton is importable."""
    return triton is not None


def interpreting() -> bool:
    """True when Triton runs kernels under its interpreter."""
    return triton is not None and bool(triton.knobs.runtime.interpret)
