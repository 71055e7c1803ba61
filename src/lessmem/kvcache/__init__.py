"""The quantized KV cache (transformers ``Cache``), its configs and presets.

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama")
    >>> switch = lessmem.kvcache.enable(model)          # fused attention over quantized data
    >>> cache = lessmem.KVCache(model.config, "kivi-4")
    >>> _ = model(torch.arange(1, 200).unsqueeze(0), cache=cache)  # older transformers: past_key_values=
    >>> mem = cache.memory()
    >>> mem["codes"] > 0, round(mem["k_bits"], 2)
    (True, 4.75)
    >>> switch.disable()
"""

from __future__ import annotations

from .attention import enable, register
from .cache import KVCache
from .config import KVConfig, KVTensorConfig
from .presets import DESCRIPTIONS, PRESETS, resolve

__all__ = ["KVCache", "KVConfig", "KVTensorConfig", "PRESETS", "DESCRIPTIONS", "resolve",
           "enable", "register"]
