"""``GGUFConfig`` in memory: each linear's weight held as raw GGUF blocks (``GGUFLinear``).

The type per linear follows ``gguf_mix.tensor_type`` with the HF→GGUF tensor names of
``gguf_mix.gguf_name`` (so Q4_K_M gives Q6_K to some ``attn_v``/``ffn_down`` layers and
to the output). Each ``nn.Linear`` is replaced by a ``GGUFLinear`` holding the bytes
llama.cpp would write (fused dequant-matmul kernel on forward), so the model really
shrinks in RAM. Exception: an ``lm_head`` tied to the input embeddings stays a float
``nn.Linear`` sharing the embedding's tensor (as llama.cpp's ``token_embd``, it is encoded
and decoded in place, so embeddings and logits see the GGUF values); holding it a second
time as blocks would add bytes, not save them. The report lists it under ``kept_float``.

Report keys: ``method``, ``config``, ``types`` (name → GGUF type, every encoded linear),
``bytes`` (GGUF bytes of all encoded weights, what a file stores), ``bits_per_weight``,
``n_quantized``, and ``kept_float`` (name → why it stays float), ``bytes_held`` (bytes the
``GGUFLinear`` layers hold, bias included).

``GGUFConfig(imatrix=...)`` (``weights.imatrix``) encodes each linear with its entry's
per-column importance, looked up by GGUF tensor name, as ``llama-quantize --imatrix``
does; every entry's length is checked first (``ValueError`` naming the tensor, before any
layer changes), and the report adds ``imatrix``: ``entries``, ``weighted`` (the linears
encoded with importance) and ``not_found`` (those without an entry, encoded without).

Example:
    >>> import lessmem
    >>> from lessmem.models import tiny_random
    >>> from lessmem.weights.gguf_apply import apply_gguf
    >>> m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    >>> rep = apply_gguf(m, lessmem.GGUFConfig("Q4_K_M"))
    >>> rep["types"]["model.layers.1.mlp.down_proj"], rep["types"]["model.layers.0.mlp.down_proj"]
    ('q6_k', 'q4_k')
    >>> type(m.model.layers[0].mlp.down_proj).__name__, rep["kept_float"]
    ('GGUFLinear', {})
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..formats.gguf import dequantize_gguf, quantize_gguf
from .arch import set_module
from .gguf_linear import GGUFLinear
from .gguf_mix import gguf_name, tensor_type

TIED_NOTE = "tied to the input embeddings: encoded and decoded in place, kept float (shared tensor)"


def gguf_plan(model: nn.Module, config, filter_fn=None) -> list[tuple[str, nn.Module, str, str]]:
    """``(module name, linear, GGUF tensor name, GGUF type)`` of each linear the mix encodes,
    in model order; a weight shared by two linears (tied) is listed once."""
    n_layers = int(getattr(model.config, "num_hidden_layers", 1))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    heads = int(getattr(model.config, "num_attention_heads", 1) or 1)
    n_gqa = heads // int(getattr(model.config, "num_key_value_heads", None) or heads)
    # an importance matrix, given or measured by the calibrated pass: llama.cpp's choices with one
    weighted = config.imatrix is not None or config.needs_calibration
    done = set()
    plan = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or any(fnmatch.fnmatchcase(name, p) for p in config.skip):
            continue
        if filter_fn is not None and not filter_fn(name, mod):
            continue
        if id(mod.weight) in done:
            continue
        done.add(id(mod.weight))
        gname = gguf_name(name) or f"{name}.weight"
        if gname == "output.weight" and tied:
            gname = "token_embd.weight"  # the tied tensor is stored once, as token_embd
        t = tensor_type(config.type, gname, mod.in_features, n_layers, has_output=not tied, n_gqa=n_gqa,
                        has_imatrix=weighted)
        plan.append((name, mod, gname, t))
    return plan


def apply_gguf(model: nn.Module, config, filter_fn=None, plan=None) -> dict:
    """Encode the linears of ``plan`` (default ``gguf_plan(model, config, filter_fn)``);
    those the plan lists that are already ``GGUFLinear`` (``GGUFConfig(gptq=True)``'s
    calibrated pass replaced them, ``weights.apply``) are counted, not encoded again."""
    from .arch import get_module

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    types, nbytes, numel, held = {}, 0, 0, 0
    kept_float: dict[str, str] = {}
    targets = gguf_plan(model, config, filter_fn) if plan is None else plan
    im = config.imatrix_data() if hasattr(config, "imatrix_data") else None
    weights = {}  # name -> per-column importance; every entry checked before any layer changes
    if im is not None:
        for name, mod, gname, _ in targets:
            weights[name] = im.for_tensor(gname, mod.in_features)
    for name, mod, _, t in targets:  # replace after the walk: named_modules must not see new modules
        now = get_module(model, name)
        if isinstance(now, GGUFLinear):  # encoded by the calibrated pass
            raw_bytes, count = now.qweight.numel(), now.in_features * now.out_features
            held += now.nbytes
        else:
            raw = quantize_gguf(mod.weight.detach(), t, imatrix=weights.get(name))
            if id(mod.weight) in embedding_weights:  # tied lm_head: decode in place, stay float
                with torch.no_grad():
                    mod.weight.copy_(dequantize_gguf(raw, t, tuple(mod.weight.shape)).to(mod.weight.dtype))
                kept_float[name] = TIED_NOTE
            else:
                q = GGUFLinear.from_raw(torch.from_numpy(raw), t, mod.in_features, mod.bias,
                                        device=mod.weight.device)
                set_module(model, name, q)
                held += q.nbytes
            raw_bytes, count = raw.nbytes, mod.weight.numel()
        types[name] = t
        nbytes += raw_bytes
        numel += count
    model._lessmem_quant = config.to_dict()
    report = {"method": "gguf", "config": config.to_dict(), "types": types, "bytes": nbytes,
              "bits_per_weight": 8.0 * nbytes / max(numel, 1), "n_quantized": len(types),
              "kept_float": kept_float, "bytes_held": held}
    if im is not None:
        report["imatrix"] = {"entries": len(im), "weighted": sorted(n for n, w in weights.items() if w is not None),
                             "not_found": [n for n, _, _, _ in targets if weights.get(n) is None]}
    return report
