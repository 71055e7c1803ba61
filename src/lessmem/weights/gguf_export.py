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


def export_gguf(src, out, mix: str = "Q4_K_M", progress: bool = True) -> dict:
    """Write ``out`` from ``src`` in the type mix ``mix``; returns a per-type tensor count and sizes."""
    import gguf

    mix = check_mix(mix)
    src, out = Path(src), Path(out)
    if not src.is_file() or src.suffix != ".gguf":
        raise ValueError(f"GGUF export needs a source .gguf file, got {str(src)!r}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    heads = reader.fields.get(f"{arch}.attention.head_count")
    kv = reader.fields.get(f"{arch}.attention.head_count_kv")
    n_gqa = int(heads.contents()) // int(kv.contents()) if heads and kv and not isinstance(
        kv.contents(), list) else 1  # query heads per KV head (llama.cpp's n_gqa)
    names = {t.name for t in reader.tensors}
    has_output = "output.weight" in names
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    _copy_metadata(reader, writer, mix)
    counts: Counter = Counter()
    nbytes = 0
    for i, t in enumerate(reader.tensors):
        shape = [int(s) for s in reversed(list(t.shape))]  # numpy order: [rows, cols]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        typ = tensor_type(mix, t.name, shape[-1], n_layers, has_output, ndim=len(shape), n_gqa=n_gqa)
        if typ == "f32":
            writer.add_tensor(t.name, w)
            nbytes += w.nbytes
        else:
            raw = quantize_gguf(w, typ)
            writer.add_tensor(t.name, raw,  # byte shape [rows, row_bytes]
                              raw_dtype=gguf.GGMLQuantizationType(gguf_type(typ).ggml_id))
            nbytes += raw.nbytes
        counts[typ] += 1
        if progress and (i % 20 == 0 or i == len(reader.tensors) - 1):
            print(f"[{i + 1}/{len(reader.tensors)}] {t.name}: {typ}", file=sys.stderr, flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"mix": mix, "tensors": dict(counts), "tensor_bytes": nbytes,
            "file_bytes": out.stat().st_size}
