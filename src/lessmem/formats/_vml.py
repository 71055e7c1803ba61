"""Give torch's vector math library (MKL VML) its first call on one thread.

torch's CPU builds compute ``cos``, ``sin``, ``exp``, ``log``, ``tanh``, ``erf`` and a few
more through MKL's VML, each call split across the intra-op threads. Seen on a two-core
Xeon with AVX-512 (torch 2.13, two threads): in about one process in twenty, the *first*
such call of the process returned the worker thread's half wrong by up to 1.5e-4 (8112 of
8192 elements off a float64 reference by more than 1e-6; the main thread's half and every
later call exact). The first call of a model's forward is the rotary embedding's ``cos``,
so one prompt's keys and queries differed run to run and greedy tokens drifted from
there: the serving engine gave different text for the same batch in a third of processes.
A first call made on one thread (8 elements stay on the caller) took it away: 0 of 120
processes wrong against 6 of 120 without it. :func:`warm_vml` makes that call for every
function torch routes to VML, float32 and float64, once per process (17 ms here, nearly all
of it MKL's own one-time set-up, which the first call pays anyway). Importing this module
(the first thing :mod:`lessmem.formats` imports) runs it, so every layer that computes
with torch has it before its first forward.

Example:
    >>> from lessmem.formats._vml import warm_vml
    >>> warm_vml()
    True
"""

from __future__ import annotations

import torch

# what aten/src/ATen/cpu/vml.h sends to MKL (IMPLEMENT_VML_MKL), and a small matmul for BLAS
_FUNCTIONS = (torch.cos, torch.sin, torch.tan, torch.acos, torch.asin, torch.atan, torch.exp,
              torch.log, torch.log2, torch.log10, torch.sqrt, torch.tanh, torch.erf, torch.erfc,
              torch.erfinv, torch.trunc)
_WARM = False


def warm_vml() -> bool:
    """Make each VML function's first call of the process on this thread alone (8 elements:
    below the size torch splits across threads). Idempotent; returns True once done."""
    global _WARM
    if not _WARM:
        with torch.no_grad():
            for dtype in (torch.float32, torch.float64):
                x = torch.linspace(0.1, 0.9, 8, dtype=dtype)
                for f in _FUNCTIONS:
                    f(x)
                torch.mm(x[None], x[:, None])
        _WARM = True
    return _WARM


warm_vml()  # on import: before the formats layer (imported by every layer that computes) runs
