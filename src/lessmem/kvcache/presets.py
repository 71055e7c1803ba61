"""Named KV-cache configurations (``lessmem presets`` lists them).

Unless stated, a preset keeps the first 4 tokens (``sinks``) and the most recent 128
(``window``) in fp16, and quantizes tokens in blocks of 32 as they leave the window.

Example:
    >>> from lessmem.kvcache.presets import PRESETS, resolve
    >>> sorted(PRESETS)[:3]
    ['best-2', 'best-3', 'best-4']
    >>> resolve("int8").keys.bits
    8
    >>> resolve("int9")
    Traceback (most recent call last):
    ...
    ValueError: unknown KV preset 'int9'; allowed: best-2, best-3, best-4, fp16, fp8, int4, int4-rot, int8, kivi-2, kivi-4, or a .json file written from KVConfig.to_dict(); either may take field=value changes after colons (window, sinks, block_size, rotation_seed, sliding, window_dtype, rotate_keys, rotate_values, key_rounding)
"""

from __future__ import annotations

from ..formats.granularity import PerGroup, PerToken
from .config import NONE, ConfigTypeError, KVConfig, KVTensorConfig


def _t(fmt: str, bits: int, gran=None) -> KVTensorConfig:
    return KVTensorConfig(fmt, bits, gran if gran is not None else PerToken())


PRESETS: dict[str, KVConfig] = {
    # the reference: nothing quantized, stored exactly as the model computes it
    "fp16": KVConfig(keys=NONE, values=NONE, window=0, sinks=0, window_dtype="model"),
    "fp8": KVConfig(keys=_t("fp8-e4m3", 8), values=_t("fp8-e4m3", 8)),
    "int8": KVConfig(keys=_t("int", 8), values=_t("int", 8)),
    "int4": KVConfig(keys=_t("uint", 4), values=_t("uint", 4)),
    # KIVI: keys per channel in groups of 32 tokens, values per token, window 128, no sinks
    "kivi-4": KVConfig(keys=_t("uint", 4, PerGroup(32, axis=-2)), values=_t("uint", 4), sinks=0),
    "kivi-2": KVConfig(keys=_t("uint", 2, PerGroup(32, axis=-2)), values=_t("uint", 2), sinks=0),
    # QuaRot-style: Hadamard-rotated keys and values, per-token int4
    "int4-rot": KVConfig(keys=_t("uint", 4), values=_t("uint", 4), rotate_keys=True, rotate_values=True),
    # best-4 / best-2: chosen among candidates (benchmarks/tune_kv_presets.py searches them on
    # wiki.train); measured on wiki.test in benchmarks/results/bench_kv_quality.json and
    # bench_kv_quality_16w.json (best-4 +0.06%, best-2 +2.19% ppl vs DynamicCache, 16 windows)
    "best-4": KVConfig(keys=_t("uint", 4, PerGroup(64, axis=-2)), values=_t("uint", 4),
                       rotate_keys=True, block_size=64, window=96),
    "best-2": KVConfig(keys=_t("uint", 3, PerGroup(64, axis=-2)), values=_t("uint", 2),
                       rotate_keys=True, rotate_values=True, block_size=64, window=96),
    # best-3: between best-4 and best-2 (benchmarks/results/kv_tuning.json on wiki.train,
    # bench_kv_quality_16w.json on wiki.test: +0.45% ppl at 3.90x vs fp16 at 4k tokens). At 3
    # bits the keys carry most of the error (k3+v4 +0.96% vs k4+v3 +0.29% on wiki.train), so
    # the bits go to the keys: 4-bit rotated keys per channel in 128-token groups (4.19 bits),
    # 3-bit Lloyd-Max values after rotation (a Gaussian codebook, TurboQuant-style; scale
    # only: 3.25 bits). With 2-bit values it measured +2.0% on wiki.test, no better than best-2.
    "best-3": KVConfig(keys=_t("uint", 4, PerGroup(128, axis=-2)), values=_t("lm", 3),
                       rotate_keys=True, rotate_values=True, block_size=128, window=64),
}

DESCRIPTIONS: dict[str, str] = {
    "fp16": "reference: no quantization (model dtype), equals DynamicCache",
    "fp8": "fp8-e4m3 per token, keys and values",
    "int8": "symmetric int8 per token",
    "int4": "asymmetric int4 per token",
    "kivi-4": "KIVI: int4 keys per channel (32-token groups), values per token, no sinks",
    "kivi-2": "KIVI: int2 keys per channel (32-token groups), values per token, no sinks",
    "int4-rot": "int4 per token with Hadamard-rotated keys and values",
    "best-4": "best 4-bit: int4 keys per channel (64 tokens) rotated, int4 values per token",
    "best-2": "best <=3-bit: 3-bit rotated per-channel keys, 2-bit rotated values per token",
    "best-3": "between: 4-bit rotated per-channel keys (128 tokens), 3-bit Lloyd-Max rotated values",
}


def load_config(path) -> KVConfig:
    """A KVConfig from a JSON file holding ``KVConfig.to_dict()`` (e.g. one
    :func:`lessmem.eval.allocate.allocate` made); ValueError naming the file otherwise."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"KV config file {str(path)!r} does not exist; allowed: a preset name or "
                         "an existing .json file written from KVConfig.to_dict()")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"KV config file {str(path)!r}: not readable JSON ({exc}); allowed: a "
                         "file written from KVConfig.to_dict()") from None
    try:
        return KVConfig.from_dict(d)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"KV config file {str(path)!r}: {exc}") from None


# KVConfig fields a preset name may change after a colon ("best-4:sliding=quantize:window=64")
OPTIONS = {"window": int, "sinks": int, "block_size": int, "rotation_seed": int, "sliding": str,
           "window_dtype": str, "rotate_keys": bool, "rotate_values": bool, "key_rounding": str}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _with_options(base: KVConfig, spec: str, options: list[str]) -> KVConfig:
    """``base`` with ``field=value`` options applied (each checked by KVConfig itself)."""
    changes = {}
    for opt in options:
        field, sep, raw = opt.partition("=")
        field, raw = field.strip(), raw.strip()
        if not sep or field not in OPTIONS or not raw:
            raise ValueError(f"KV option {opt!r} in {spec!r}; allowed: field=value with field one of "
                             f"{', '.join(OPTIONS)}")
        kind = OPTIONS[field]
        if kind is bool:
            if raw.lower() not in _BOOLS:
                raise ValueError(f"KV option {field}={raw!r} in {spec!r}; allowed: true or false")
            changes[field] = _BOOLS[raw.lower()]
        elif kind is int:
            if not raw.isdigit():
                raise ValueError(f"KV option {field}={raw!r} in {spec!r}; allowed: an integer >= 0")
            changes[field] = int(raw)
        else:
            changes[field] = raw
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as exc:  # KVConfig's own checks, named with the spec
        raise ValueError(f"KV config {spec!r}: {exc}") from None


def resolve(config) -> KVConfig:
    """A :class:`KVConfig` from a preset name, a ``.json`` file holding ``KVConfig.to_dict()``
    or a KVConfig (returned as is). A name or file may carry changes of KVConfig's scalar
    fields after colons (``OPTIONS``): ``"best-4:sliding=quantize"`` is best-4 with its
    sliding-window layers quantized too, ``"int8:window=32:sinks=0"``.

    Example:
        >>> c = resolve("best-4:sliding=quantize:window=64")
        >>> c.sliding, c.window, c.keys == resolve("best-4").keys
        ('quantize', 64, True)
    """
    if isinstance(config, KVConfig):
        return config
    names = ", ".join(sorted(PRESETS))
    if isinstance(config, str):
        if config in PRESETS:
            return PRESETS[config]
        base, *options = config.split(":")
        if options and (base in PRESETS or base.endswith(".json")):
            return _with_options(resolve(base), config, options)
        if config.endswith(".json"):
            return load_config(config)
        raise ValueError(f"unknown KV preset {config!r}; allowed: {names}, or a .json file "
                         "written from KVConfig.to_dict(); either may take field=value changes "
                         f"after colons ({', '.join(OPTIONS)})")
    hint = "; a dict: use KVConfig.from_dict(d)" if isinstance(config, dict) else ""
    raise ConfigTypeError(f"KV config {config!r} (a {type(config).__name__}){hint}; allowed: a "
                          f"preset name ({names}) or a KVConfig")
