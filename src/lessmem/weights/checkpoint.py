"""Quantized checkpoints: ``save_quantized(model, dir)`` and ``load_quantized(dir)``.

Format (a directory):

- ``lessmem_quant.json`` — ``{"format": "lessmem-quant", "version": 1, "architecture":
  "<transformers class>", "model_config": {...}, "quantization": {method config},
  "modules": {name: {"bits", "group_size", "symmetric", "act_bits", "in_features",
  "out_features", "bias"}}, "tied": {key: stored key}}`` (tied tensors stored once)
- ``model.safetensors`` — every float parameter/buffer of the model except the quantized
  linears, plus per quantized linear ``<name>.qweight`` (codes ``u [N, K]`` packed with
  ``formats.packing.pack_bits``: little-endian bit stream, row-major), ``<name>.scale``
  (fp16 ``[N, K/group_size]``), ``<name>.zero_point`` (uint8 ``[N, K/group_size]``, code
  units; 2^(b-1) when symmetric) and ``<name>.bias``.  W_hat = scale · (u − zero_point).
- ``GGUFLinear`` layers (``GGUFConfig``): ``<name>.qweight`` holds the raw GGUF blocks
  (uint8 ``[N, row_bytes]``, llama.cpp's bytes) and ``<name>.bias``; the config lists them
  under ``"gguf_modules": {name: {"gguf_type", "in_features", "out_features", "bias"}}``.
- the tokenizer files, when a tokenizer is given.

``lessmem.load(dir)`` calls ``load_quantized`` when ``lessmem_quant.json`` exists.

Example:
    >>> import tempfile, torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> from lessmem.weights.checkpoint import load_quantized
    >>> m = tiny_random("llama")
    >>> _ = lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    >>> d = tempfile.mkdtemp()
    >>> lessmem.save_quantized(m, d)
    >>> m2, _ = load_quantized(d)
    >>> x = torch.randint(0, 256, (1, 8))
    >>> torch.equal(m(x).logits, m2(x).logits)
    True
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..formats.packing import pack_bits, unpack_bits
from .arch import set_module
from .gguf_linear import GGUFLinear
from .qlinear import QuantLinear
from .rtn import QuantizedWeight

MARKER = "lessmem_quant.json"
WEIGHTS = "model.safetensors"


def save_quantized(model, directory, tokenizer=None) -> None:
    """Write ``model`` (with its QuantLinear layers) to ``directory`` (see the module doc)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors: dict[str, torch.Tensor] = {}
    modules = {}
    for name, m in qmods.items():
        tensors[f"{name}.qweight"] = pack_bits(m.codes(), m.bits)
        tensors[f"{name}.scale"] = m.scales().to(torch.float16)
        tensors[f"{name}.zero_point"] = m.zero().to(torch.uint8)
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.data
        modules[name] = {"bits": m.bits, "group_size": m.group_size, "symmetric": m.symmetric,
                         "act_bits": m.act_bits, "in_features": m.in_features,
                         "out_features": m.out_features, "bias": m.bias is not None}
    gguf_modules = {n: {"gguf_type": m.gguf_type, "in_features": m.in_features,
                        "out_features": m.out_features, "bias": m.bias is not None}
                    for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    for key, t in model.state_dict().items():  # GGUFLinear: its qweight and bias, as they are
        owner = key.rpartition(".")[0]
        if owner in qmods:
            continue
        tensors[key] = t
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key in list(tensors):  # tied tensors (lm_head = embeddings) are stored once
        ptr = tensors[key].data_ptr()
        if ptr in seen:
            tied[key] = seen[ptr]
            del tensors[key]
            continue
        seen[ptr] = key
        tensors[key] = tensors[key].detach().contiguous()
    save_file(tensors, str(d / WEIGHTS))
    meta = {"format": "lessmem-quant", "version": 1,
            "architecture": type(model).__name__,
            "model_config": model.config.to_dict(),
            "quantization": getattr(model, "_lessmem_quant", None),
            "modules": modules, "tied": tied}
    if gguf_modules:
        meta["gguf_modules"] = gguf_modules
    (d / MARKER).write_text(json.dumps(meta, indent=1, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))


def load_quantized(directory):
    """``(model, tokenizer or None)`` from a directory written by ``save_quantized``."""
    import transformers
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / MARKER).exists():
        raise ValueError(f"{d} holds no {MARKER}; not a lessmem quantized checkpoint")
    meta = json.loads((d / MARKER).read_text())
    if meta.get("format") != "lessmem-quant" or meta.get("version") != 1:
        raise ValueError(f"{d / MARKER}: format={meta.get('format')!r} version={meta.get('version')!r}; "
                         "allowed: lessmem-quant version 1")
    cfg_dict = dict(meta["model_config"])
    config = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    cls = getattr(transformers, meta["architecture"], None)
    model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_file(str(d / WEIGHTS))
    qkeys = set()
    for name, spec in meta["modules"].items():
        n, k, bits = spec["out_features"], spec["in_features"], spec["bits"]
        codes = unpack_bits(tensors.pop(f"{name}.qweight"), bits, n * k).view(n, k)
        qw = QuantizedWeight(codes, tensors.pop(f"{name}.scale"), tensors.pop(f"{name}.zero_point"),
                             bits, spec["group_size"], spec["symmetric"])
        bias = tensors.pop(f"{name}.bias") if spec["bias"] else None
        q = QuantLinear.from_quantized(qw, bias, spec["act_bits"])
        set_module(model, name, q)
        qkeys.update(f"{name}.{key}" for key in q.state_dict())
    for name, spec in meta.get("gguf_modules", {}).items():  # filled by load_state_dict below
        set_module(model, name, GGUFLinear(spec["in_features"], spec["out_features"],
                                           spec["gguf_type"], spec["bias"]))
    tied = meta.get("tied", {})
    for key, src in tied.items():  # re-tie what save_quantized stored once
        if key not in tensors and src in tensors:
            tensors[key] = tensors[src]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [key for key in missing if key not in qkeys]
    if missing or unexpected:
        raise ValueError(f"{d / WEIGHTS} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model._lessmem_quant = meta.get("quantization")
    model.eval()
    tok = None
    if (d / "tokenizer_config.json").exists() or (d / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(d))
    return model, tok
