"""KV-cache bytes on paper: raw precisions and lessmem cache presets, metadata included.

Per token the cache adds 2·L·H_kv·d elements (keys and values, every layer and KV
head). At b bytes per element that is 2·L·H_kv·d·b bytes — 65,536·b for Llama-3-8B
(L 32, H_kv 8, d 128). A quantized cache also stores, per group of elements, a scale
(and a zero point when asymmetric), keeps the first ``sinks`` tokens and the most
recent ``window`` tokens in full precision, and may leave whole layers unquantized.

Convention: the bare names ``fp16 bf16 fp8 int8 int4 int2`` (and ``kXvY`` such as
``k8v4``) count the codes only (65,536·b bytes per token for Llama-3-8B). Metadata and windows
are counted for the lessmem cache presets — ``lessmem:fp8``, ``lessmem:int8``,
``lessmem:int4`` (prefixed where the name clashes), ``kivi-4``, ``kivi-2``, ``int4-rot``,
``best-4``, ``best-2`` — or when options are given: ``int4:g=32:zp=1:window=128:sinks=4``.

Groups are (tokens × channels) sharing one scale: per-token keys/values in groups of
g channels are (1, g); KIVI keys per channel in groups of G tokens are (G, 1). Tokens
leave the window ``block`` at a time, so the full-precision part of a request of T
tokens is T − n_q with n_q = ⌊(T − sinks − window)⁺ / block⌋·block quantized tokens.

Example:
    >>> from lessmem.plan.kv import kv_bytes, get_kv
    >>> from lessmem.plan.models import get_model
    >>> m = get_model("llama-3-8b")
    >>> kv_bytes(m, 1, 1, get_kv("fp16"))["total"]
    131072
    >>> kv_bytes(m, 16384, 16, get_kv("fp8"))["total"] == 16 * 2**30
    True
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from ..base.kvprecision import QUALITY, KVPrecision  # noqa: F401  (re-export)


def _groups(n_tokens: int, head_dim: int, tokens: int, channels: int | None) -> int:
    """Scale groups covering n_tokens × head_dim elements of one head (partial groups count)."""
    ch = head_dim if channels is None else min(channels, head_dim)
    return math.ceil(n_tokens / tokens) * math.ceil(head_dim / ch)


def split_tokens(context: int, p: KVPrecision) -> tuple[int, int]:
    """(quantized tokens, full-precision tokens) of one request of ``context`` tokens."""
    free = max(0, context - p.sinks - p.window)
    n_q = (free // p.block) * p.block
    return n_q, context - n_q


def layer_quant_bytes(model, p: KVPrecision, n_tokens: int, batch: int = 1) -> tuple[float, float]:
    """(codes, meta) bytes of ``n_tokens`` quantized tokens of one layer for ``batch`` requests
    (pass batch·layers for several layers): codes ``B·H·n·D·(k_bits + v_bits)/8``, meta one
    scale (and zero point) per group per head, ``B·H·(groups_k·k_meta + groups_v·v_meta)``."""
    H, D = model.kv_heads, model.head_dim
    codes = batch * H * n_tokens * D * (p.k_bits + p.v_bits) / 8
    k_meta = p.k_scale_bytes + p.k_zero_point_bytes
    v_meta = p.v_scale_bytes + p.v_zero_point_bytes
    meta = batch * H * (_groups(n_tokens, D, p.k_group_tokens, p.k_group_channels) * k_meta
                        + _groups(n_tokens, D, p.v_group_tokens, p.v_group_channels) * v_meta)
    return codes, meta


def kv_bytes(model, context: int, batch: int, p: KVPrecision) -> dict:
    """Bytes the KV cache holds for ``batch`` requests of ``context`` tokens, by part.

    ``model`` needs ``layers``, ``kv_heads``, ``head_dim`` (a ModelDims or any object
    with those attributes). Returns base units: ``codes``, ``scales`` (scales and zero
    points), ``full`` (window, sinks and skipped layers), ``total``, ``per_request``,
    ``per_token`` (mean over all tokens), ``fp16`` (the same cache in fp16), and the
    effective bits of a quantized K and V element (codes + metadata).
    """
    for k, v in (("context", context), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{k}={v!r} must be a non-negative integer")
    L, H, D = model.layers, model.kv_heads, model.head_dim
    if p.skip_layers > L:
        raise ValueError(f"skip_layers={p.skip_layers} exceeds the model's {L} layers")
    Lq = L - p.skip_layers
    n_q, n_full = split_tokens(context, p)
    elems = H * D  # one of K or V, one layer, one token
    # codes: [B, Lq, n_q, H, D] at k_bits and v_bits; scales: per group per head
    codes, scales = layer_quant_bytes(model, p, n_q, batch * Lq)
    k_meta = p.k_scale_bytes + p.k_zero_point_bytes
    v_meta = p.v_scale_bytes + p.v_zero_point_bytes
    full = batch * (Lq * n_full + p.skip_layers * context) * 2 * elems * p.full_bytes
    total = codes + scales + full
    k_elems_group = p.k_group_tokens * min(p.k_group_channels or D, D)
    v_elems_group = p.v_group_tokens * min(p.v_group_channels or D, D)
    tokens = batch * context
    return {
        "context": context, "batch": batch, "precision": p.name,
        "quantized_tokens": n_q, "full_precision_tokens": n_full,
        "codes": int(math.ceil(codes)), "scales": int(math.ceil(scales)), "full": int(math.ceil(full)),
        "total": int(math.ceil(total)),
        "per_request": int(math.ceil(total / batch)) if batch else 0,
        "per_token": total / tokens if tokens else bytes_per_token(model, p),
        "fp16": tokens * 2 * L * elems * 2,
        "k_bits_effective": p.k_bits + 8 * k_meta / k_elems_group,
        "v_bits_effective": p.v_bits + 8 * v_meta / v_elems_group,
    }


def bytes_per_token(model, p: KVPrecision) -> float:
    """Marginal bytes of one more *quantized* token (metadata amortised over its group)."""
    L, H, D = model.layers, model.kv_heads, model.head_dim
    Lq = L - p.skip_layers
    k_elems_group = p.k_group_tokens * min(p.k_group_channels or D, D)
    v_elems_group = p.v_group_tokens * min(p.v_group_channels or D, D)
    k = p.k_bits / 8 + (p.k_scale_bytes + p.k_zero_point_bytes) / k_elems_group
    v = p.v_bits / 8 + (p.v_scale_bytes + p.v_zero_point_bytes) / v_elems_group
    return Lq * H * D * (k + v) + p.skip_layers * 2 * H * D * p.full_bytes


# ---------------------------------------------------------------- named precisions

def _raw(name, k, v=None, quality="lossy", desc=""):
    v = k if v is None else v
    return KVPrecision(name, k, v, quality=quality, description=desc or f"{name}: codes only, no metadata")


RAW: dict[str, KVPrecision] = {
    "fp32": _raw("fp32", 32, quality="reference", desc="fp32, 4 bytes/element"),
    "fp16": _raw("fp16", 16, quality="reference", desc="fp16, 2 bytes/element (the baseline)"),
    "bf16": _raw("bf16", 16, quality="reference", desc="bf16, 2 bytes/element"),
    "fp8": _raw("fp8", 8, quality="near-lossless", desc="fp8 (E4M3), 1 byte/element; typically <0.05% ppl"),
    "fp8-e4m3": _raw("fp8-e4m3", 8, quality="near-lossless", desc="fp8 E4M3, 1 byte/element"),
    "fp8-e5m2": _raw("fp8-e5m2", 8, quality="near-lossless", desc="fp8 E5M2, 1 byte/element"),
    "int8": _raw("int8", 8, quality="near-lossless", desc="int8, 1 byte/element; typically ~0.1-0.3% ppl"),
    "int4": _raw("int4", 4, desc="int4, 0.5 byte/element; typically 1-5% ppl without outlier protection"),
    "int3": _raw("int3", 3, desc="int3, 3 bits/element"),
    "int2": _raw("int2", 2, desc="int2, 0.25 byte/element"),
}


def _lessmem(name, kb, vb, kg=(1, None), vg=(1, None), zp=1.0, rot=False, window=128, sinks=4, block=32,
             quality="lossy", desc="", vzp=None):
    # lessmem.kvcache conventions: fp16 scales, uint8 zero points (asymmetric only), window
    # and sinks in fp16, tokens leave the window in blocks. vzp: the values' zero-point bytes
    # where they differ from the keys' (a codebook side has none).
    return KVPrecision(name, kb, vb, kg[0], kg[1], vg[0], vg[1], 2.0, 2.0, zp, zp if vzp is None else vzp,
                       window=window, sinks=sinks, block=block, full_bytes=2.0, rotated=rot,
                       quality=quality, description=desc)


# Mirrors lessmem.kvcache.PRESETS (KVConfig.to_plan gives the same KVPrecision; tests/plan
# checks that, and that these bytes match a filled cache's memory()). Names clashing with a
# bare precision get the "lessmem:" prefix.
LESSMEM: dict[str, KVPrecision] = {
    p.name: p for p in (
        KVPrecision("lessmem:fp16", 16, 16, quality="reference",
                    description="lessmem fp16 preset: nothing quantized (= DynamicCache)"),
        _lessmem("lessmem:fp8", 8, 8, zp=0.0, quality="near-lossless",
                 desc="fp8-e4m3 per token (fp16 scale), window 128, sinks 4"),
        _lessmem("lessmem:int8", 8, 8, zp=0.0, quality="near-lossless",
                 desc="symmetric int8 per token, window 128, sinks 4"),
        _lessmem("lessmem:int4", 4, 4, desc="asymmetric int4 per token, window 128, sinks 4"),
        _lessmem("kivi-4", 4, 4, (32, 1), sinks=0,
                 desc="KIVI: int4 keys per channel (32-token groups), values per token, window 128"),
        _lessmem("kivi-2", 2, 2, (32, 1), sinks=0,
                 desc="KIVI: int2 keys per channel (32-token groups), values per token, window 128"),
        _lessmem("int4-rot", 4, 4, rot=True, desc="int4 per token, Hadamard-rotated keys and values"),
        _lessmem("best-4", 4, 4, (64, 1), rot=True, window=96, block=64,
                 desc="int4 keys per channel (64 tokens) rotated, int4 values per token, window 96"),
        _lessmem("best-2", 3, 2, (64, 1), rot=True, window=96, block=64,
                 desc="3-bit rotated per-channel keys (64 tokens), 2-bit rotated values per token"),
        _lessmem("best-3", 4, 3, (128, 1), rot=True, window=64, block=128, vzp=0.0,
                 desc="int4 rotated per-channel keys (128 tokens), 3-bit Lloyd-Max rotated values per token"),
    )
}

_OPT_KEYS = {
    "g": "group", "group": "group", "kg": "k_tokens", "k_tokens": "k_tokens", "scale": "scale",
    "zp": "zp", "window": "window", "w": "window", "sinks": "sinks", "s": "sinks",
    "block": "block", "skip": "skip", "full": "full",
}


def kv_choices() -> str:
    return (", ".join([*RAW, *LESSMEM]) + ", kXvY (e.g. k8v4), or NAME:opt=val:... with opts "
            "g (channels per scale), kg (keys per-channel, tokens per scale), scale (bytes), "
            "zp (bytes), window, sinks, block, skip (full-precision layers)")


def _parse_int(name, v, spec):
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"KV option {name}={v!r} in {spec!r} is not a number; allowed: {kv_choices()}") from None
    if name != "scale" and name != "zp" and name != "full" and x != int(x):
        raise ValueError(f"KV option {name}={v!r} in {spec!r} must be a whole number")
    return x


def get_kv(spec: str | KVPrecision, num_layers: int | None = None) -> KVPrecision:
    """A KVPrecision from a name (see ``kv_choices()``), a ``NAME:opt=val`` spec, any object
    with ``to_plan()`` (a ``lessmem.kvcache.KVConfig``; duck-typed so torch is never imported),
    or a ``.json`` file holding ``KVConfig.to_dict()`` (a per-layer allocation from
    ``lessmem kv-allocate``: read with lessmem.kvcache, which imports torch). A config whose
    layers differ in bits is described by its mean bits over ``num_layers`` layers (the
    model's count), which it then needs.

    Example:
        >>> p = get_kv("int4:g=32:zp=1:window=128:sinks=4")
        >>> p.k_bits, p.k_group_channels, p.k_scale_bytes + p.k_zero_point_bytes, p.window
        (4, 32, 3.0, 128)
    """
    if isinstance(spec, KVPrecision):
        return spec
    if hasattr(spec, "to_plan"):
        return spec.to_plan("custom", num_layers=num_layers)
    if isinstance(spec, str) and spec.strip().lower().endswith(".json"):
        from pathlib import Path

        from ..kvcache.presets import load_config  # a ValueError naming the file if it is not one

        path = spec.strip()
        return load_config(path).to_plan(Path(path).stem, num_layers=num_layers)
    s = str(spec).strip().lower()
    base, *opts = s.split(":") if not s.startswith("lessmem:") else ["lessmem:" + s.split(":")[1],
                                                                   *s.split(":")[2:]]
    if base in RAW:
        p = RAW[base]
    elif base in LESSMEM:
        p = LESSMEM[base]
    elif m := re.fullmatch(r"k(\d+)v(\d+)", base):
        kb, vb = int(m.group(1)), int(m.group(2))
        p = KVPrecision(base, kb, vb, quality="near-lossless" if min(kb, vb) >= 8 else "lossy",
                        description=f"keys {kb} bits, values {vb} bits, codes only")
    elif m := re.fullmatch(r"int([2-8])", base):
        p = _raw(base, int(m.group(1)))
    else:
        raise ValueError(f"unknown KV precision {spec!r}; choose one of: {kv_choices()}")
    if not opts:
        return p
    ch: dict = {"name": s}
    for o in opts:
        if "=" not in o:
            raise ValueError(f"KV option {o!r} in {spec!r} needs a value (opt=val); allowed: {kv_choices()}")
        k, v = o.split("=", 1)
        key = _OPT_KEYS.get(k.strip())
        if key is None:
            raise ValueError(f"unknown KV option {k!r} in {spec!r}; allowed: {', '.join(sorted(set(_OPT_KEYS)))}")
        x = _parse_int(key, v.strip(), spec)
        if key == "group":
            ch.update(k_group_channels=int(x), v_group_channels=int(x))
            ch.setdefault("k_scale_bytes", 2.0)
            ch.setdefault("v_scale_bytes", 2.0)
        elif key == "k_tokens":
            ch.update(k_group_tokens=int(x), k_group_channels=1)
            ch.setdefault("k_scale_bytes", 2.0)
        elif key == "scale":
            ch.update(k_scale_bytes=x, v_scale_bytes=x)
        elif key == "zp":
            ch.update(k_zero_point_bytes=x, v_zero_point_bytes=x)
        elif key == "full":
            ch["full_bytes"] = x
        else:
            ch[{"skip": "skip_layers"}.get(key, key)] = int(x)
    return replace(p, **ch)
