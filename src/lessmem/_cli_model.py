"""What a model's config says, read before its weights load: the CLI checks lengths and
group sizes against it before any work starts (``lessmem eval/generate/quantize/explore``).

Example:
    >>> peek_model("no/such/model") is None
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from lessmem import _cli_types as T


def peek_model(name: str) -> dict | None:
    """What a model's config says, read before any weights load (None where that needs the
    model itself: a hub id, or the built-in model before its first download).

    Returns ``{"context": max positions or None, "in_features": {the linears' input
    widths}}`` from a directory's ``config.json``, a ``.gguf`` file's header, or the
    built-in model's cached files.
    """
    p = Path(str(name)).expanduser()
    if p.is_dir():
        return _from_hf_config(p / "config.json")
    if p.is_file() and p.suffix == ".gguf":
        return _from_gguf_header(p)
    try:
        from lessmem import models

        spec = models.BUILTIN.get(str(name))
    except ImportError:
        return None
    if spec is None:
        return None
    cached = sorted(models.cache_dir("models").glob(f"{spec.alias}-{spec.sha256[:12]}-*/config.json"))
    if cached:
        return _from_hf_config(cached[0])
    gguf_path = models.cache_dir("models") / spec.member
    return _from_gguf_header(gguf_path) if gguf_path.is_file() else None


def _shape(context, hidden, heads, head_dim, intermediate) -> dict:
    feats = {int(x) for x in (hidden, intermediate) if x}
    if heads and head_dim:
        feats.add(int(heads) * int(head_dim))
    return {"context": int(context) if context else None, "in_features": feats}


def _from_hf_config(path: Path) -> dict | None:
    import json

    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the loader says what is wrong with it
    if not isinstance(cfg, dict):
        return None
    cfg = {**cfg, **(cfg.get("text_config") or {})} if isinstance(cfg.get("text_config"), dict) else cfg
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    ints = [v for v in (cfg.get("max_position_embeddings"), hidden, heads, head_dim,
                        cfg.get("intermediate_size")) if v is not None]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
        return None
    return _shape(cfg.get("max_position_embeddings"), hidden, heads, head_dim, cfg.get("intermediate_size"))


def _from_gguf_header(path: Path) -> dict | None:
    """The few numbers we need from a GGUF header (stops early; None on anything unexpected)."""
    try:
        kv = _gguf_header_values(path, ("context_length", "embedding_length", "feed_forward_length",
                                        "attention.head_count", "attention.key_length"))
    except (OSError, ValueError, OverflowError):
        return None
    if kv is None:
        return None
    hidden, heads = kv.get("embedding_length"), kv.get("attention.head_count")
    head_dim = kv.get("attention.key_length") or (hidden // heads if hidden and heads else None)
    return _shape(kv.get("context_length"), hidden, heads, head_dim, kv.get("feed_forward_length"))


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_header_values(path: Path, wanted: tuple[str, ...]) -> dict | None:
    """``{suffix: int}`` for the ``<arch>.<suffix>`` keys in ``wanted`` (GGUF v2/v3 header)."""
    import struct

    out: dict = {}
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size

        def read(n: int) -> bytes:
            if n < 0 or f.tell() + n > end:
                raise ValueError("truncated")
            return f.read(n)

        def string() -> str:
            return read(struct.unpack("<Q", read(8))[0]).decode("utf-8", "replace")

        if read(4) != b"GGUF" or struct.unpack("<I", read(4))[0] not in (2, 3):
            return None
        _n_tensors, n_kv = struct.unpack("<QQ", read(16))
        arch = None
        for _ in range(min(n_kv, 10_000)):
            key, vtype = string(), struct.unpack("<I", read(4))[0]
            if vtype == 8:
                val = string()
            elif vtype == 9:  # an array: skip it (the tokenizer's vocabulary lives in these)
                etype, n = struct.unpack("<IQ", read(12))
                if etype == 8:
                    for _ in range(n):
                        read(struct.unpack("<Q", read(8))[0])
                elif etype in _GGUF_SCALARS:
                    read(n * struct.calcsize("<" + _GGUF_SCALARS[etype]))
                else:
                    return None
                continue
            elif vtype in _GGUF_SCALARS:
                fmt = "<" + _GGUF_SCALARS[vtype]
                val = struct.unpack(fmt, read(struct.calcsize(fmt)))[0]
            else:
                return None
            if key == "general.architecture":
                arch = val
            elif arch and key.startswith(arch + ".") and key[len(arch) + 1:] in wanted:
                if isinstance(val, int) and val > 0:
                    out[key[len(arch) + 1:]] = val
            if len(out) == len(wanted):
                break
    return out


def check_model(name: str, option: str = "--model") -> None:
    """OptionError unless ``name`` can name a model: a built-in alias, a ``.gguf`` file, a
    model directory (``config.json`` or a lessmem checkpoint), or a hub id ``org/name``
    (the same rules as :func:`lessmem.models.load`, checked without loading anything)."""
    from lessmem import models
    from lessmem._cli_types import OptionError

    p = Path(str(name)).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        if _from_gguf_header(p) is None:
            raise OptionError(option, name, "not a valid GGUF file (its header does not parse); allowed: "
                              "a .gguf file, a model directory, a hub id or a built-in alias")
        return
    if name in models.BUILTIN:
        return
    if p.is_dir() and str(name).strip():
        if (p / "config.json").is_file() or (p / models.QUANT_MARKER).is_file():
            return
        raise OptionError(option, name, f"the directory has no config.json (nor {models.QUANT_MARKER}); "
                          "allowed: a HF model directory, a .gguf file, a hub id or a built-in alias")
    if not p.exists() and models._looks_like_hub_id(str(name)):
        return
    raise OptionError(option, name, f"unknown model {str(name)!r}; allowed: a built-in alias "
                      f"({', '.join(models.BUILTIN)}), an existing .gguf file or model directory, "
                      "or a hub id org/name")


WEIGHTS_HELP = ("stored (default): a GGUF file's quantized weights kept as its blocks, memory-mapped, "
                "never inflated to floats; float: dequantized to float32 by transformers")


def add_weights_option(p) -> None:
    """``--weights stored|float``, passed to ``lessmem.load(..., weights=)``."""
    p.add_argument("--weights", choices=("stored", "float"), default="stored", help=WEIGHTS_HELP)


def add_device_option(p) -> None:
    p.add_argument("--device", type=T.device, default="auto",
                   help="where the model runs: auto (a CUDA device when there is one), cpu, cuda, cuda:N "
                        "(default auto)")


def to_device(model, args):
    """``model`` moved to ``--device`` (a GGUF model's blocks stay blocks); returns the device."""
    device = T.resolve_device(getattr(args, "device", "cpu"))
    if device != "cpu":
        model.to(device)
    return device
