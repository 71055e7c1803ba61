"""The planner: bytes and seconds on paper, for models and machines you don't have.

Pure arithmetic — this package never imports torch. ``plan(...)`` returns every
number as a dict in base units (bytes, seconds, bytes/s, tokens); ``lessmem plan``
prints it as tables.

Example:
    >>> from lessmem.plan import plan
    >>> p = plan("llama-3-8b", context=16384, batch=16, kv="fp16,fp8,int4", kv_budget="4GiB")
    >>> [r["per_request"] / 2**30 for r in p["kv"]]
    [2.0, 1.0, 0.5]
    >>> p["hybrid"]["chosen"]
    'fp8'
"""

from ..base.tierspec import TierSpec, format_offload_spec, parse_offload_spec
from .hardware import HARDWARE_PRESETS, Hardware, get_hardware, pcie_bandwidth
from .kv import LESSMEM as KV_PRESETS
from .kv import RAW as KV_RAW
from .kv import KVPrecision, bytes_per_token, get_kv, kv_bytes
from .models import MODEL_PRESETS, ModelDims, from_hf_config, get_model
from .planner import plan
from .speed import decode_floor, transfer_times
from .tiers import tier_split
from .weights import WeightFormat, get_weight_format, weight_footprint

__all__ = [
    "plan", "kv_bytes", "bytes_per_token", "KVPrecision", "get_kv", "KV_PRESETS", "KV_RAW",
    "ModelDims", "MODEL_PRESETS", "get_model", "from_hf_config", "Hardware", "HARDWARE_PRESETS",
    "get_hardware", "pcie_bandwidth", "WeightFormat", "get_weight_format", "weight_footprint",
    "transfer_times", "decode_floor", "tier_split", "TierSpec", "parse_offload_spec", "format_offload_spec",
]
