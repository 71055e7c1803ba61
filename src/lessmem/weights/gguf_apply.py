"""``GGUFConfig`` in memory: encode each linear's weight in its GGUF type, decode in place.

The type per linear follows ``gguf_mix.tensor_type`` with the HF→GGUF tensor names of
``gguf_mix.gguf_name`` (so Q4_K_M gives Q6_K to some ``attn_v``/``ffn_down`` layers and
to the output). The weights stay ``nn.Linear`` (float) holding exactly the values
llama.cpp would decode; the report gives the GGUF bytes and bits per weight.

Example:
    >>> import lessmem
    >>> from lessmem.models import tiny_random
    >>> from lessmem.weights.gguf_apply import apply_gguf
    >>> m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    >>> rep = apply_gguf(m, lessmem.GGUFConfig("Q4_K_M"))
    >>> rep["types"]["model.layers.1.mlp.down_proj"], rep["types"]["model.layers.0.mlp.down_proj"]
    ('q6_k', 'q4_k')
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..formats.gguf import dequantize_gguf, quantize_gguf
from .gguf_mix import gguf_name, tensor_type


def apply_gguf(model: nn.Module, config, filter_fn=None) -> dict:
    n_layers = int(getattr(model.config, "num_hidden_layers", 1))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    heads = int(getattr(model.config, "num_attention_heads", 1) or 1)
    n_gqa = heads // int(getattr(model.config, "num_key_value_heads", None) or heads)
    types, nbytes, numel = {}, 0, 0
    done = set()
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or any(fnmatch.fnmatchcase(name, p) for p in config.skip):
            continue
        if filter_fn is not None and not filter_fn(name, mod):
            continue
        if id(mod.weight) in done:
            continue
        gname = gguf_name(name) or f"{name}.weight"
        if gname == "output.weight" and tied:
            gname = "token_embd.weight"  # the tied tensor is stored once, as token_embd
        t = tensor_type(config.type, gname, mod.in_features, n_layers, has_output=not tied,
                        n_gqa=n_gqa)
        raw = quantize_gguf(mod.weight.detach(), t)
        with torch.no_grad():
            mod.weight.copy_(dequantize_gguf(raw, t, tuple(mod.weight.shape)).to(mod.weight.dtype))
        done.add(id(mod.weight))
        types[name] = t
        nbytes += raw.nbytes
        numel += mod.weight.numel()
    model._lessmem_quant = config.to_dict()
    return {"method": "gguf", "config": config.to_dict(), "types": types, "bytes": nbytes,
            "bits_per_weight": 8.0 * nbytes / max(numel, 1), "n_quantized": len(types)}
