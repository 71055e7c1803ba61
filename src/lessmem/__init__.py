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

# OpenMP threads that wait for work sleep instead of spinning. The OpenMP runtime reads
# this once, when torch is first imported; by default its idle threads spin for a while,
# taking cores that other processes' work needs (beside one busy process, PASSIVE decoded
# 1.34x as fast as spinning: benchmarks/results/bench_contention.json; what keeps decode
# from collapsing there is fewer threads, lessmem.base.cpu). Effective when lessmem is
# imported before torch (the `lessmem` command
# always is); otherwise set OMP_WAIT_POLICY=PASSIVE in the environment. An explicit
# setting (e.g. ACTIVE on a dedicated machine) is kept.
OMP_POLICY_FROM_LESSMEM = "OMP_WAIT_POLICY" not in os.environ  # (`lessmem serve` takes it back)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
}

__all__ = ["__version__", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
