"""Loading a ``.gguf`` file as it is stored: its quantized weights are never inflated to floats.

``lessmem.load("x.gguf")`` (and the built-in model) builds the transformers model of the
file's architecture on the ``meta`` device (no memory) and fills it from the file mapped
into memory (``torch.from_file``, a private mapping: pages are read from the file when first
touched and counted once, however many layers view them):

- a linear whose tensor has one of the twelve block types the kernels read (the ten of
  ``formats.gguf``'s ``GGUF_TYPES`` and IQ4_NL / IQ4_XS) becomes a
  ``GGUFLinear`` whose ``qweight`` *is* the file's bytes (a view, no copy), run by the fused
  dequant-matmul kernel when decoding. For ``llama`` files the ``attn_q``/``attn_k`` rows
  are in llama.cpp's rotary order (its converter interleaves each head's pairs; transformers'
  own GGUF loader reorders them): they stay mapped as stored and the layer gives its
  outputs in transformers' order (``GGUFLinear``'s ``out_perm``: a gather of the outputs,
  no copy of the rows);
- ``token_embd`` becomes a ``GGUFEmbedding``: the rows of the looked-up tokens are decoded
  per call, never the table;
- a tied ``lm_head`` is a ``GGUFLinear`` over the same tensor (held once);
- F32/F16/BF16 tensors (norms, biases) are copied as floats (they are small), and a weight
  of another type (the other IQ types) is decoded to floats with the ``gguf`` package, listed in
  the report's ``inflated``.

The model's ``_lessmem_gguf`` report says what was held how: ``file``, ``types`` (HF name →
GGUF type), ``bytes_mapped`` (file bytes the layers view), ``bytes_copied`` (bytes held
outside the mapping), ``inflated``. Architectures: ``ARCHS``; other files are loaded by
transformers with float weights (``lessmem.load(..., weights="float")`` always does that).

Example:
    >>> import os, tempfile
    >>> from lessmem.models import tiny_random
    >>> from lessmem.weights.gguf_export import write_model_gguf
    >>> m = tiny_random("llama", hidden_size=256, intermediate_size=512)
    >>> path = write_model_gguf(m, os.path.join(tempfile.mkdtemp(), "tiny.gguf"), "q8_0")
    >>> g = load_gguf_blocks(path, config=m.config)
    >>> type(g.model.layers[0].mlp.up_proj).__name__, type(g.model.embed_tokens).__name__
    ('GGUFLinear', 'GGUFEmbedding')
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

from ..formats.gguf_file import read_gguf_header
from ..kernels import gguf_linear_cpp as kernel
from ..kernels import linear_ops  # noqa: F401  (registers torch.ops.lessmem.gguf_dequantize)
from .arch import set_module
from .gguf_linear import GGUFLinear

ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # general.architecture values loaded as blocks
_PERMUTED = ("llama",)  # q/k rows interleaved by llama.cpp's converter (as transformers undoes)
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# GGUF tensor name -> HF parameter name (per layer: blk.N.<x> -> model.layers.N.<y>)
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def hf_name(gguf_tensor: str) -> str | None:
    """``blk.3.ffn_down.weight`` -> ``model.layers.3.mlp.down_proj.weight`` (None if unknown).

    Example:
        >>> hf_name("blk.3.attn_k.bias"), hf_name("token_embd.weight"), hf_name("rope_freqs.weight")
        ('model.layers.3.self_attn.k_proj.bias', 'model.embed_tokens.weight', None)
    """
    if gguf_tensor in _GLOBAL:
        return _GLOBAL[gguf_tensor]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_tensor)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def gguf_tensor_name(hf: str) -> str | None:
    """The inverse of :func:`hf_name`: ``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``.

    Example:
        >>> gguf_tensor_name("model.layers.0.self_attn.q_proj.weight"), gguf_tensor_name("x")
        ('blk.0.attn_q.weight', None)
    """
    for g, h in _GLOBAL.items():
        if hf == h:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if m:
        for g, h in _LAYER.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}.{m.group(3)}"
    return None


class GGUFEmbedding(nn.Module):
    """An embedding table held as raw GGUF rows ``[num_embeddings, row_bytes]``: a call decodes
    only the rows of its token ids (float32, cast to ``dtype``)."""

    def __init__(self, qweight: torch.Tensor, gguf_type, embedding_dim: int, dtype=torch.float32):
        super().__init__()
        self._type = kernel.check_shape(gguf_type, qweight.shape[0], embedding_dim)
        self.num_embeddings, self.embedding_dim = int(qweight.shape[0]), int(embedding_dim)
        self.padding_idx = None
        self.dtype = dtype
        self.register_buffer("qweight", qweight)

    @property
    def gguf_type(self) -> str:
        return self._type.name

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        # (traced by torch.compile the ids are not known yet: the eager call checks them)
        if (not torch.compiler.is_compiling() and flat.numel()
                and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings)):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}), got "
                             f"{int(flat.min())}..{int(flat.max())}")
        rows = self.qweight.index_select(0, flat.to(self.qweight.device))
        # the op: C++ on the CPU, the Triton decoder on CUDA (kernels.linear_ops)
        out = torch.ops.lessmem.gguf_dequantize(rows, self._type.ggml_id, rows.shape[0], self.embedding_dim)
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf_type={self.gguf_type}"


def permute_rows(rows: torch.Tensor, n_head: int, inverse: bool = True) -> torch.Tensor:
    """Reorder the rows of a q/k projection between llama.cpp's rotary layout (each head's
    pairs interleaved) and transformers' (each head's two halves); ``inverse=True`` goes
    llama.cpp -> transformers. Works on float rows and on raw block rows alike (a copy)."""
    n = rows.shape[0]
    a, b = (n // n_head // 2, 2) if inverse else (2, n // n_head // 2)
    return rows.reshape(n_head, a, b, -1).transpose(1, 2).reshape(n, -1).contiguous()


def load_gguf_blocks(path, dtype: torch.dtype = torch.float32, config=None, int8_activations: bool = True,
                     *, header=None):
    """The causal LM of the ``.gguf`` file at ``path`` with its weights held as stored (module doc).

    ``config``: the transformers config (default: read from the file by ``AutoConfig``).
    ``int8_activations``: decode steps multiply Q4_0/Q4_1/Q8_0 blocks with int8-quantized
    activations, as llama.cpp does (``GGUFLinear``); ``False`` keeps float32 activations.
    ``header``: the file's ``read_gguf_header`` result if the caller already holds it.
    Raises ``ValueError`` for an architecture outside ``ARCHS`` or a file whose tensors do
    not fill the model, before anything large is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if header is None:
        header = read_gguf_header(path)
    arch = str(header.metadata.get("general.architecture", ""))
    if arch not in ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not loaded as GGUF blocks (allowed: "
                         f"{', '.join(ARCHS)}); load it with weights='float'")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not allowed; use torch.float32, bfloat16 or float16")
    if not isinstance(int8_activations, bool):
        raise ValueError(f"int8_activations={int8_activations!r} must be True or False")
    if config is None:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = {t.name: t for t in header.tensors}
    names = {t.name: hf_name(t.name) for t in header.tensors}
    wanted = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in wanted if n not in names.values()
               and not (n == "lm_head.weight" and "token_embd.weight" in tensors)]
    if missing:
        raise ValueError(f"{path}: the file has no tensor for {', '.join(missing[:4])}"
                         f"{' …' if len(missing) > 4 else ''} (architecture {arch})")
    whole = torch.from_file(os.fspath(path), shared=False, size=header.file_size, dtype=torch.uint8)
    report = {"file": os.fspath(path), "types": {}, "bytes_mapped": 0, "bytes_copied": 0, "inflated": []}
    heads = {"self_attn.q_proj": config.num_attention_heads,
             "self_attn.k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    embed, floats = None, []
    for gname, name in names.items():  # the block weights first: a bias is set on the new module
        if name is None or name not in wanted:
            continue
        info = tensors[gname]
        raw = whole[info.offset:info.offset + info.nbytes]
        module_name, _, kind = name.rpartition(".")
        shape = tuple(reversed(info.shape))  # ggml order is fastest dimension first
        if tuple(wanted[name].shape) != shape and not (len(shape) == 1 and wanted[name].numel() == shape[0]):
            raise ValueError(f"{path}: tensor {gname} has shape {shape}; the model's {name} needs "
                             f"{tuple(wanted[name].shape)}")
        qtype = info.type_name.lower()
        if not (kind == "weight" and len(shape) == 2 and qtype in kernel.KERNEL_TYPES):
            floats.append((name, raw, info, shape))
            continue
        rows = raw.view(shape[0], -1)
        sub = module_name.split(".", 3)[-1] if module_name.startswith("model.layers.") else ""
        perm = None
        if arch in _PERMUTED and sub in heads:  # mapped as stored: the layer reorders its outputs
            perm = permute_rows(torch.arange(shape[0]).view(-1, 1), heads[sub]).view(-1)
        report["bytes_mapped"] += rows.numel()
        report["types"][module_name] = qtype
        if module_name == "model.embed_tokens":
            embed = GGUFEmbedding(rows, qtype, shape[1], dtype)
            set_module(model, module_name, embed)
        else:
            old = model.get_submodule(module_name)
            set_module(model, module_name, GGUFLinear(shape[1], shape[0], qtype, old.bias is not None,
                                                      qweight=rows, int8_activations=int8_activations,
                                                      out_perm=perm))
    for name, raw, info, shape in floats:  # norms, biases, float weights
        value = _float_tensor(raw, info, shape, report, name)
        module_name = name.rpartition(".")[0]
        sub = module_name.split(".", 3)[-1] if module_name.startswith("model.layers.") else ""
        if arch in _PERMUTED and sub in heads and len(shape) == 2:  # llama.cpp's q/k row order, as above
            value = permute_rows(value, heads[sub])
        report["bytes_copied"] += value.numel() * value.element_size()
        _set_tensor(model, name, value.to(dtype))
    if "output.weight" not in tensors:  # tied: the lm_head reads the embedding's own tensor
        if embed is not None:
            set_module(model, "lm_head", GGUFLinear(embed.embedding_dim, embed.num_embeddings,
                                                    embed.gguf_type, False, qweight=embed.qweight,
                                                    int8_activations=int8_activations))
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    _real_rotary(model)
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise ValueError(f"{path}: nothing in the file sets {n} (architecture {arch})")
    model._lessmem_gguf = report
    return model.eval()


def _float_tensor(raw: torch.Tensor, info, shape, report: dict, name: str) -> torch.Tensor:
    if info.type_name in _FLOAT_TYPES:
        return raw.clone().view(_FLOAT_TYPES[info.type_name]).reshape(shape)
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    report["inflated"].append(name)
    print(f"lessmem: {name} is {info.type_name}, which lessmem's kernels do not read; decoded to "
          "float32", file=sys.stderr)
    out = dequantize(raw.numpy(), GGMLQuantizationType(info.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, attr)
    setattr(module, attr, nn.Parameter(value.reshape(old.shape), requires_grad=False))


def _real_rotary(model: nn.Module) -> None:
    """Rotary modules made on the meta device hold no frequencies: build them again on the CPU."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "inv_freq"):
            with torch.device("cpu"):
                new = type(mod)(config=mod.config)
            set_module(model, name, new)
