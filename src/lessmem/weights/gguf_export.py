"""GGUF export: re-encode a source GGUF model's tensors with a llama.cpp type mix.

``export_gguf(src, out, "Q4_K_M")`` reads ``src`` with ``gguf.GGUFReader``, copies every
metadata key (architecture, hyper-parameters, the tokenizer vocabulary, merges, chat
template; ``general.file_type`` set to the new mix), decodes each tensor to float32
(``gguf.quants.dequantize``) and writes it in the type ``gguf_mix.tensor_type`` picks,
encoded by ``lessmem.formats.gguf.quantize_gguf`` (llama.cpp's byte layout), with
``gguf.GGUFWriter``. The result loads in llama.cpp, ``gguf.GGUFReader`` and
``transformers`` (``from_pretrained(dir, gguf_file=...)``).

Example:
    >>> from lessmem.weights.gguf_export import export_gguf      # doctest: +SKIP
    >>> export_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smol.Q4_K_M.gguf", "Q4_K_M")  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

from ..formats.gguf import gguf_type, quantize_gguf
from ..formats.gguf_file import open_gguf_reader
from .gguf_mix import FILE_TYPE_IDS, check_mix, tensor_type

_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")


def _copy_metadata(reader, writer, mix: str) -> None:
    import gguf

    for name, field in reader.fields.items():
        if name.startswith(_SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPE_IDS[mix])


def add_tensors(writer, tensors, mix: str, n_layers: int, has_output: bool, n_gqa: int = 1,
                progress: bool = False, total: int | None = None) -> tuple[dict, int]:
    """Add each ``(gguf_name, float array)`` of ``tensors`` to the ``gguf.GGUFWriter`` in the
    type ``gguf_mix.tensor_type`` picks for ``mix`` (``n_layers``, ``has_output``, ``n_gqa``:
    query heads per KV head, as llama.cpp's rules take them); arrays in numpy order
    ([rows, cols]), cast to float32. Returns (name → type, bytes of the tensor data)."""
    import gguf

    types: dict[str, str] = {}
    nbytes = 0
    for i, (name, a) in enumerate(tensors):
        w = np.asarray(a, dtype=np.float32)
        typ = tensor_type(mix, name, w.shape[-1], n_layers, has_output, ndim=w.ndim, n_gqa=n_gqa)
        if typ == "f32":
            writer.add_tensor(name, w)
            nbytes += w.nbytes
        else:
            raw = quantize_gguf(w, typ)
            writer.add_tensor(name, raw,  # byte shape [rows, row_bytes]
                              raw_dtype=gguf.GGMLQuantizationType(gguf_type(typ).ggml_id))
            nbytes += raw.nbytes
        types[name] = typ
        if progress and (i % 20 == 0 or (total is not None and i == total - 1)):
            print(f"[{i + 1}/{total if total is not None else '?'}] {name}: {typ}", file=sys.stderr, flush=True)
    return types, nbytes


class Source:
    """A source ``.gguf`` opened for re-encoding: its reader and what llama.cpp's type rules
    read from it (``arch``, ``n_layers``, ``n_gqa``: query heads per KV head, ``has_output``),
    and ``plan``: tensor name -> (shape in numpy order, type ``mix`` gives it; ``has_imatrix``:
    as llama.cpp chooses when given an importance matrix)."""

    def __init__(self, src, mix: str, has_imatrix: bool = False):
        self.mix = check_mix(mix)
        self.path = src = Path(src)
        if not src.is_file() or src.suffix != ".gguf":
            raise ValueError(f"GGUF export needs a source .gguf file, got {str(src)!r}")
        self.reader = reader = open_gguf_reader(src)  # a damaged file: ValueError("not a valid GGUF file: ...")
        self.arch = arch = reader.fields["general.architecture"].contents()
        self.n_layers = int(reader.fields[f"{arch}.block_count"].contents())
        heads = reader.fields.get(f"{arch}.attention.head_count")
        kv = reader.fields.get(f"{arch}.attention.head_count_kv")
        self.n_gqa = int(heads.contents()) // int(kv.contents()) if heads and kv and not isinstance(
            kv.contents(), list) else 1  # query heads per KV head (llama.cpp's n_gqa)
        self.has_output = any(t.name == "output.weight" for t in reader.tensors)
        self.plan = {}
        for t in reader.tensors:
            shape = [int(s) for s in reversed(list(t.shape))]  # numpy order: [rows, cols]
            self.plan[t.name] = (shape, tensor_type(self.mix, t.name, shape[-1], self.n_layers,
                                                    self.has_output, ndim=len(shape), n_gqa=self.n_gqa,
                                                    has_imatrix=has_imatrix))

    def write(self, out, encode=None, add_keys=None, progress: bool = True, given=None) -> dict:
        """Write ``out``: the metadata copied (``add_keys(writer)`` may change it), every tensor
        decoded to float32 and written in its planned type, ``encode(name, w, typ)`` giving the
        raw bytes (default ``quantize_gguf(w, typ)``); a tensor in ``given`` is written as
        that array instead (float32 values for an F32 tensor, raw rows for a block type), its
        source never decoded. Returns the export report."""
        import gguf

        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(out), self.arch)
        _copy_metadata(self.reader, writer, self.mix)
        if add_keys is not None:
            add_keys(writer)
        types: dict[str, str] = {}
        nbytes = 0
        tensors = self.reader.tensors
        for i, t in enumerate(tensors):
            shape, typ = self.plan[t.name]
            data = given.get(t.name) if given else None
            if data is None:
                w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
                data = w if typ == "f32" else quantize_gguf(w, typ) if encode is None else encode(t.name, w, typ)
            if typ == "f32":
                writer.add_tensor(t.name, data)
            else:
                writer.add_tensor(t.name, data,  # byte shape [rows, row_bytes]
                                  raw_dtype=gguf.GGMLQuantizationType(gguf_type(typ).ggml_id))
            nbytes += data.nbytes
            types[t.name] = typ
            if progress and (i % 20 == 0 or i == len(tensors) - 1):
                print(f"[{i + 1}/{len(tensors)}] {t.name}: {typ}", file=sys.stderr, flush=True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return {"mix": self.mix, "tensors": dict(Counter(types.values())), "tensor_bytes": nbytes,
                "file_bytes": out.stat().st_size}


def export_gguf(src, out, mix: str = "Q4_K_M", progress: bool = True) -> dict:
    """Write ``out`` from ``src`` in the type mix ``mix``; returns a per-type tensor count and sizes."""
    return Source(src, mix).write(out, progress=progress)


def export_gguf_encoded(src, out, mix: str, model, add_keys=None, progress: bool = True,
                        has_imatrix: bool = True) -> dict:
    """``src`` re-encoded in ``mix`` (``Source.write``), except that every linear ``model``
    holds as a ``GGUFLinear`` (e.g. after ``quantize_(model, GGUFConfig(mix, gptq=True))``
    on ``lessmem.load(src, weights="float")``) is written as the rows it holds, its q/k rows
    put back in llama.cpp's rotary order for a ``llama`` file. Each such linear must be a
    tensor of ``src`` in the type the mix gives it there (``ValueError`` otherwise, before
    the file opens). The F32 tensors (norms, biases) are written from ``model`` too, so
    scales AWQ folded into a norm or bias reach the file (q/k biases, which no fold
    changes, stay the source's: a ``llama`` file holds them in its own row order).
    ``has_imatrix``: the mix's types as llama.cpp chooses them with an importance matrix (as
    ``gguf_plan`` does for a calibrated ``GGUFConfig``; only IQ4's ffn_down differs)."""
    from .gguf_linear import GGUFLinear
    from .gguf_load import _PERMUTED, hf_name, permute_rows
    from .gguf_mix import gguf_name

    source = Source(src, mix, has_imatrix=has_imatrix)
    cfg = model.config
    heads = {"self_attn.q_proj": cfg.num_attention_heads,
             "self_attn.k_proj": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    given = {}  # the linears' rows, and the F32 tensors from the model
    for name, mod in model.named_modules():
        if not isinstance(mod, GGUFLinear):
            continue
        gname = gguf_name(name)
        if gname not in source.plan:
            raise ValueError(f"{name} has no tensor in {source.path.name}; was the model loaded from it?")
        typ = source.plan[gname][1]
        if typ != mod.gguf_type:
            raise ValueError(f"{name} holds {mod.gguf_type.upper()} rows; {mix} gives {gname} {typ.upper()}")
        rows = mod.rows_in_output_order().detach().cpu()
        sub = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if source.arch in _PERMUTED and sub in heads:
            rows = permute_rows(rows, heads[sub], inverse=False)
        given[gname] = rows.numpy()
    params = dict(model.named_parameters())
    for gname, (shape, typ) in source.plan.items():
        hf = hf_name(gname)
        if typ != "f32" or hf not in params or hf.endswith(("q_proj.bias", "k_proj.bias")):
            continue
        v = params[hf].detach().float().cpu().numpy()
        if list(v.shape) != list(shape):
            raise ValueError(f"{hf} has shape {list(v.shape)}; {gname} in {source.path.name} has {shape}")
        given[gname] = v
    return source.write(out, add_keys=add_keys, progress=progress, given=given)


def write_model_gguf(model, out, qtype: str = "q8_0", tokenizer_model: str | None = None) -> Path:
    """Write a transformers Llama/Qwen2/Mistral ``model`` to ``out`` with every linear and the
    embedding in the GGUF type ``qtype`` (norms and biases F32; ``"f32"``: everything F32,
    a float source for llama.cpp's own quantizer), in llama.cpp's tensor names
    and q/k row order, with the hyper-parameters transformers reads back (``AutoConfig``).
    No tokenizer is written: the file is for code that feeds token ids (tests, benchmarks);
    ``tokenizer_model="none"`` records that (``tokenizer.ggml.model``), which llama.cpp
    needs to load a file without a vocabulary (token ids in, logits out).

    Example:
        >>> import tempfile, os
        >>> from lessmem.models import tiny_random
        >>> p = write_model_gguf(tiny_random("llama", hidden_size=64), os.path.join(tempfile.mkdtemp(), "t.gguf"))
        >>> p.stat().st_size > 0
        True
    """
    import gguf
    import torch

    from .gguf_load import gguf_tensor_name, permute_rows

    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(cfg.model_type)
    if arch is None:
        raise ValueError(f"write_model_gguf writes llama, mistral and qwen2 models, got {cfg.model_type!r}")
    t = None if str(qtype).lower() == "f32" else gguf_type(qtype)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    out = Path(out)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_block_count(int(cfg.num_hidden_layers))
    w.add_feed_forward_length(int(cfg.intermediate_size))
    w.add_head_count(int(heads))
    w.add_head_count_kv(int(kv_heads))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_vocab_size(int(cfg.vocab_size))
    if tokenizer_model is not None:
        w.add_tokenizer_model(tokenizer_model)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, p in model.state_dict().items():
        gname = gguf_tensor_name(name)
        if gname is None or (tied and gname == "output.weight"):
            continue
        a = p.detach().to(torch.float32).cpu()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            a = permute_rows(a, heads if "attn_q" in gname else kv_heads, inverse=False)
        a = a.numpy()
        if t is not None and a.ndim == 2 and a.shape[1] % t.block_size == 0:
            w.add_tensor(gname, quantize_gguf(a, t.name), raw_dtype=gguf.GGMLQuantizationType(t.ggml_id))
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
