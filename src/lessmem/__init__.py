"""lessmem: make large language models fit in less memory.

Importing this package is cheap: it does not import transformers or initialise CUDA.
Public names are resolved lazily from their layer on first use.

Example:
    >>> import lessmem
    >>> lessmem.__version__
    '0.1.0'
"""

from __future__ import annotations

import os

# OpenMP threads that wait for work spin for a short while (about half a millisecond),
# then sleep. The OpenMP runtime reads this once, when torch is first imported. Its
# default spins much longer, taking cores that other processes' work needs; sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) makes every parallel region wake a sleeping thread,
# and a decode step runs hundreds of them
# (benchmarks/results/bench_contention.json measures the three; what keeps decode from
# collapsing beside busy processes is fewer threads, lessmem.base.cpu). Effective when
# lessmem is imported before torch (the `lessmem` command always is). An explicit
# OMP_WAIT_POLICY, GOMP_SPINCOUNT (libgomp) or KMP_BLOCKTIME (LLVM/Intel OpenMP) is kept.
SPIN_SETTINGS = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", *SPIN_SETTINGS)  # any one set by the user: lessmem sets none
OMP_POLICY_FROM_LESSMEM = not any(v in os.environ for v in OMP_WAIT_VARS)
if OMP_POLICY_FROM_LESSMEM:  # (`lessmem serve` takes it back)
    os.environ.update(SPIN_SETTINGS)

from lessmem.base.lazy import lazy_exports  # noqa: E402

__version__ = "0.1.0"

# public name -> module that defines it (resolved on first attribute access)
_LAZY = {
    # formats
    "QTensor": "lessmem.formats",
    "PerTensor": "lessmem.formats",
    "PerChannel": "lessmem.formats",
    "PerToken": "lessmem.formats",
    "PerGroup": "lessmem.formats",
    "SuperBlock": "lessmem.formats",
    "quantize": "lessmem.formats",
    # models
    "load": "lessmem.models",
    "load_tokenizer": "lessmem.models",
    "lean_decode": "lessmem.decode",
    # kv cache
    "KVCache": "lessmem.kvcache",
    "KVConfig": "lessmem.kvcache",
    "TieredKVCache": "lessmem.kvcache.tiered",
    # weights
    "quantize_": "lessmem.weights",
    "save_quantized": "lessmem.weights",
    "RTNConfig": "lessmem.weights",
    "HQQConfig": "lessmem.weights",
    "GPTQConfig": "lessmem.weights",
    "AWQConfig": "lessmem.weights",
    "SmoothQuantConfig": "lessmem.weights",
    "GGUFConfig": "lessmem.weights",
    "FP8Config": "lessmem.weights",
}

__all__ = ["__version__", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
