"""The caches the evaluator compares: lessmem presets, KVConfigs and peer caches.

A config is named by a string:

- ``"dynamic"``: transformers' ``DynamicCache`` (the unquantized baseline);
- ``"quanto-int4"``, ``"quanto-int2"``, ``"hqq-int4"``, ``"hqq-int2"``: transformers'
  ``QuantizedCache`` with that backend and its defaults (residual window 128), when the
  backend package is installed; ``"hf-fp8"``: its per-tensor FP8 backend;
- any name in ``lessmem.kvcache.PRESETS``;

or given as a ``KVConfig`` or a :class:`CacheSpec` (a name plus a factory building the
cache from the model config, e.g. for custom caches in tests).

Bytes are what the cache holds: ``cache.memory()`` for lessmem caches; for the others,
every tensor found on the cache layers (quanto's packed tensors are unflattened down
to their storage) — keys and values at their real dtype, so an fp32 ``DynamicCache``
costs 4 bytes per element. ``fp16_kv_bytes`` is 2 bytes per logical K/V element held.

Example:
    >>> from lessmem.models import tiny_random
    >>> spec = resolve_configs(["dynamic"])[0]
    >>> cache = spec.make(tiny_random().config)
    >>> type(cache).__name__, spec.kind
    ('DynamicCache', 'baseline')
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lessmem.kvcache.cache import cache_kwarg  # noqa: F401  (re-exported for eval callers)
from lessmem.kvcache.shape import head_dim

BASELINE = "dynamic"
PEERS = {
    # name: (backend, nbits, python package that backend needs or None)
    "quanto-int4": ("quanto", 4, "optimum.quanto"),
    "quanto-int2": ("quanto", 2, "optimum.quanto"),
    "hqq-int4": ("hqq", 4, "hqq"),
    "hqq-int2": ("hqq", 2, "hqq"),
    "hf-fp8": ("fp8", None, None),
}


@dataclass(frozen=True)
class CacheSpec:
    """A named way to build a cache for a model config.

    ``kind`` is ``"baseline"``, ``"lessmem"``, ``"peer"`` or ``"custom"``; ``detail``
    is a JSON-able description (the KVConfig dict for lessmem caches).

    Example:
        >>> from transformers import DynamicCache
        >>> spec = CacheSpec("mine", lambda cfg: DynamicCache(config=cfg))
        >>> spec.kind
        'custom'
    """

    name: str
    factory: Callable[[Any], Any]
    kind: str = "custom"
    detail: Any = None
    config: Any = None  # the preset name or KVConfig of a lessmem cache (what with_offload needs)
    takes_model: bool = False  # the factory also takes model= (the model the cache will serve)

    def make(self, model_config, model=None):
        """The cache for ``model_config``. ``model``: the model it will serve, for caches
        that use it (a tiered cache names its stored state by the model's weights and
        recomputes blocks a tier lost); ignored by the others."""
        if model is not None and self.takes_model:
            return self.factory(model_config, model=model)
        return self.factory(model_config)


def _module_available(name: str | None) -> bool:
    if name is None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _backend_missing(name: str) -> str | None:
    """Why peer ``name`` cannot run here (None: it can): its package is not installed, or
    the installed transformers has no such ``QuantizedCache`` backend (``fp8`` is newer
    than the oldest transformers lessmem supports)."""
    backend, _, pkg = PEERS[name]
    if not _module_available(pkg):
        return f"needs the {pkg!r} package, which is not installed"
    if backend == "fp8":
        import transformers
        from transformers import cache_utils

        if not hasattr(cache_utils, "Fp8QuantizedLayer"):
            return (f"needs transformers' fp8 QuantizedCache backend, which transformers "
                    f"{transformers.__version__} does not have")
    return None


def available_peers() -> list[str]:
    """Peer cache names whose backend is installed here."""
    return [n for n in PEERS if _backend_missing(n) is None]


def lessmem_presets() -> dict:
    """A copy of ``lessmem.kvcache.PRESETS`` (name -> KVConfig)."""
    from lessmem.kvcache import PRESETS

    return dict(PRESETS)


def _dynamic(cfg):
    from transformers import DynamicCache

    return DynamicCache(config=cfg)


def _peer_factory(backend: str, nbits: int | None):
    def make(cfg):
        from transformers import QuantizedCache

        if nbits is None:
            return QuantizedCache(backend, cfg)
        return QuantizedCache(backend, cfg, nbits=nbits)

    return make


def _lessmem_factory(preset):
    def make(cfg):
        from lessmem.kvcache import KVCache

        return KVCache(cfg, preset)

    return make


def resolve_config(config) -> CacheSpec:
    """One config (name, KVConfig or CacheSpec) -> :class:`CacheSpec`; ValueError if unknown."""
    if isinstance(config, CacheSpec):
        return config
    if isinstance(config, str):
        name = config.strip()
        if name == BASELINE:
            return CacheSpec(BASELINE, _dynamic, "baseline", {"cache": "transformers.DynamicCache"})
        if name in PEERS:
            backend, nbits, pkg = PEERS[name]
            missing = _backend_missing(name)
            if missing:
                raise ValueError(f"peer cache {name!r} {missing}")
            detail = {"cache": "transformers.QuantizedCache", "backend": backend, "nbits": nbits}
            return CacheSpec(name, _peer_factory(backend, nbits), "peer", detail)
        presets = lessmem_presets()
        if name in presets:
            return CacheSpec(name, _lessmem_factory(name), "lessmem", _to_dict(presets[name]), name)
        base, colon, changes = name.partition(":")
        if base.endswith(".json") or (colon and base in presets):
            # a KVConfig saved with to_dict (e.g. a per-layer allocation), or a preset or such a
            # file with field=value changes after colons: kvcache.presets.resolve reads both
            from lessmem.kvcache.presets import resolve

            cfg = resolve(name)
            label = (Path(base).stem if base.endswith(".json") else base) + colon + changes
            return CacheSpec(label, _lessmem_factory(cfg), "lessmem", cfg.to_dict(), cfg)
        allowed = [BASELINE, *available_peers(), *presets]
        raise ValueError(f"unknown KV config {name!r}; allowed: {', '.join(allowed)}, or a .json "
                         "file written from KVConfig.to_dict(); a lessmem preset or file may take "
                         "field=value changes after colons (best-4:sliding=quantize)")
    if hasattr(config, "to_dict") and type(config).__name__ == "KVConfig":
        d = config.to_dict()
        same = [n for n, p in lessmem_presets().items() if p == config]
        digest = hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]
        name = same[0] if same else f"kvconfig-{digest}"
        return CacheSpec(name, _lessmem_factory(config), "lessmem", d, config)
    raise ValueError(f"KV config must be a preset name, a KVConfig or a CacheSpec, got {config!r}")


def with_offload(spec, offload: str, kv_budget=None, block_tokens: int = 256,
                 prefetch: bool = True) -> CacheSpec:
    """The same lessmem config held in a :class:`~lessmem.kvcache.tiered.TieredKVCache`.

    ``offload``: the tiers below the device (``"host,disk:/path,redis://h:6379/0"``, see
    :func:`lessmem.offload.parse_offload_spec`); ``kv_budget``: device bytes (``"64MiB"``;
    None = unbounded). Every cache the spec makes builds its own tiers from the string
    (a disk directory or Redis server is shared; each cache's blocks have their own keys
    and ``close()`` removes them). The tiered cache is bit-exact with the in-memory one,
    so the name stays; ``detail`` records the tiers and budget. ``spec.make(cfg, model=model)``
    binds the model (stored state keyed by its weights, lost blocks recomputed: see
    :mod:`lessmem.kvcache.tiered.recovery`); lessmem's eval and generate pass it.

    Example:
        >>> from lessmem.models import tiny_random
        >>> spec = with_offload(resolve_config("int4"), "host", "64KiB")
        >>> cache = spec.make(tiny_random().config)
        >>> type(cache).__name__, cache.device_budget, spec.detail["offload"]
        ('TieredKVCache', 65536, 'host')
        >>> cache.close()
    """
    from lessmem.base.placement import check_lower_tiers
    from lessmem.base.tierspec import redact_offload_text
    from lessmem.offload import check_block_tokens, parse_bytes, parse_offload_spec

    spec = resolve_config(spec)
    if spec.kind != "lessmem" or spec.config is None:
        raise ValueError(f"--offload needs a lessmem preset or KVConfig, got {spec.name!r} ({spec.kind}); "
                         "allowed: the names `lessmem presets` lists")
    # syntax errors before any model loads; the device tier is implicit (its size is --kv-budget)
    check_lower_tiers(parse_offload_spec(offload), what=f"--offload {redact_offload_text(offload)!r}", budget_name="--kv-budget")
    budget = None if kv_budget is None else parse_bytes(kv_budget, "--kv-budget")
    preset = spec.config
    from lessmem.kvcache.presets import resolve

    check_block_tokens(block_tokens, resolve(preset).block_size, spec.name)

    def make(cfg, model=None):
        from lessmem.kvcache.tiered import TieredKVCache

        return TieredKVCache(cfg, preset, tiers=offload, device_budget=budget,
                             block_tokens=block_tokens, prefetch=prefetch, model=model)

    detail = {**(spec.detail if isinstance(spec.detail, dict) else {"config": spec.detail}),
              "offload": redact_offload_text(offload), "device_budget": budget, "block_tokens": block_tokens,
              "prefetch": bool(prefetch)}
    return CacheSpec(spec.name, make, "lessmem", detail, preset, takes_model=True)


def close_cache(cache) -> None:
    """Close a cache that holds resources (a tiered cache's prefetch thread, files, Redis
    keys); other caches have nothing to close."""
    close = getattr(cache, "close", None)
    if callable(close):
        close()


def placement(mem: dict) -> dict | None:
    """Where a tiered cache's bytes are, from its ``memory()`` dict (None for other caches):
    ``device_bytes`` (now), ``device_peak`` (the cache's peak, or the bytes now if more: the
    peak is sampled at reads), ``device_budget``, ``tiers`` (bytes per tier) and ``resident``
    (window + sinks, which stay on the device whatever the budget)."""
    if not isinstance(mem.get("tiers"), dict):
        return None
    now = mem.get("device_bytes", 0)
    return {"device_bytes": now, "device_peak": max(mem.get("device_peak", 0), now),
            "device_budget": mem.get("device_budget"), "tiers": dict(mem["tiers"]),
            "resident": mem.get("window", 0) + mem.get("sinks", 0)}


def resolve_configs(configs) -> list[CacheSpec]:
    """Resolve a list (or comma-separated string) of configs; names must be unique."""
    if isinstance(configs, str):
        configs = [c for c in configs.split(",") if c.strip()]
    specs = [resolve_config(c) for c in configs]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"KV configs must be unique, got {', '.join(dup)} more than once")
    return specs


def _to_dict(cfg):
    return cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)


# ----------------------------------------------------------------------------- bytes


def _tensors(obj, depth: int = 0):
    """Every plain storage tensor inside ``obj`` (tensor subclasses unflattened)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from _tensors(getattr(obj, n), depth + 1)
        else:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o, depth + 1)


def _logical_numel(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], torch.Tensor):
        return obj[0].numel()  # (codes, scale) pairs, e.g. transformers' fp8 layer
    return 0


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def measure_memory(cache) -> dict:
    """Bytes a cache holds: ``total``, ``fp16_equivalent``, ``k_bits``, ``v_bits`` and parts.

    lessmem caches report through ``cache.memory()``; for transformers caches the
    tensors on each layer are summed: ``keys``/``values`` (full precision, the residual
    window of quantized caches) and ``_quantized_keys``/``_quantized_values``.
    ``k_bits``/``v_bits`` are bits per element over the quantized tokens (over all
    tokens when nothing is quantized).
    """
    if hasattr(cache, "memory") and callable(cache.memory):
        mem = dict(cache.memory())
        if "total" not in mem:
            raise ValueError(f"cache.memory() of {type(cache).__name__} lacks 'total': {sorted(mem)}")
        return mem
    parts = {"window": 0, "quantized": 0}
    side = {s: {"fp_b": 0, "fp_n": 0, "q_b": 0, "q_n": 0} for s in ("k", "v")}
    for layer in getattr(cache, "layers", []):
        for s, fp_attr, q_attr in (("k", "keys", "_quantized_keys"), ("v", "values", "_quantized_values")):
            fp, q = getattr(layer, fp_attr, None), getattr(layer, q_attr, None)
            if isinstance(fp, torch.Tensor) and fp.numel():
                side[s]["fp_b"] += _nbytes(fp)
                side[s]["fp_n"] += fp.numel()
            if q is not None:
                side[s]["q_b"] += _nbytes(q)
                side[s]["q_n"] += _logical_numel(q)
    for s in side.values():
        parts["window"] += s["fp_b"]
        parts["quantized"] += s["q_b"]

    def bits(s):
        if s["q_n"]:
            return 8.0 * s["q_b"] / s["q_n"]
        return 8.0 * s["fp_b"] / s["fp_n"] if s["fp_n"] else 0.0

    n = sum(s["fp_n"] + s["q_n"] for s in side.values())
    return {
        **parts,
        "total": parts["window"] + parts["quantized"],
        "fp16_equivalent": 2 * n,
        "k_bits": bits(side["k"]),
        "v_bits": bits(side["v"]),
    }


@torch.inference_mode()
def memory_at_length(spec: CacheSpec, model_config, n_tokens: int, chunk: int = 256,
                     dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Bytes a fresh cache holds after ``n_tokens`` random K/V tokens (batch 1).

    Tokens enter through ``cache.update`` in chunks of ``chunk``, layer by layer, as a
    forward pass would feed them; no model runs, so this is cheap at any length. Byte
    counts do not depend on the values, only on what the cache keeps (windows, sinks,
    metadata). For models whose layers all attend fully.

    Example:
        >>> from lessmem.models import tiny_random
        >>> m = memory_at_length(resolve_config("dynamic"), tiny_random().config, 100)
        >>> m["total"] == 2 * 2 * 2 * 100 * 16 * 4   # layers x (K, V) x heads x T x D x fp32
        True
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r}; allowed: an integer >= 1")
    cfg = model_config
    H = cfg.num_key_value_heads
    D = head_dim(cfg)
    cache = spec.make(cfg)
    g = torch.Generator().manual_seed(seed)
    for s in range(0, n_tokens, chunk):
        t = min(chunk, n_tokens - s)
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(1, H, t, D, generator=g).to(dtype)  # [B, H_kv, T, D]
            v = torch.randn(1, H, t, D, generator=g).to(dtype)
            cache.update(k, v, layer)
    return measure_memory(cache)
