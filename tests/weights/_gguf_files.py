"""Shared by the GGUF weight tests: a tiny model as a GGUF file transformers reads back, and
RMSNorm weights spread out so input columns differ in scale."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from lessmem.models import tiny_tokenizer


def spread_norms(model, seed: int = 1) -> None:
    """Give the RMSNorm weights log-normal spreads, so input columns differ in scale (as the
    outlier channels of real models do) and the importance matrix is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.exp(1.5 * torch.randn(p.shape, generator=g)))



def tiny_gguf(path, model) -> None:
    """``model`` as an F32 GGUF file with a byte-level tokenizer, which ``lessmem.load``
    (transformers) reads back: ``write_model_gguf``'s tensors and keys plus tokenizer keys."""
    from lessmem.weights.gguf_export import write_model_gguf

    raw = write_model_gguf(model, path.with_name("raw.gguf"), "f32")
    r = gguf.GGUFReader(str(raw))
    w = gguf.GGUFWriter(str(path), "llama")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    vocab = tiny_tokenizer().get_vocab()
    tokens = sorted(vocab, key=vocab.get) + ["ĠĠ"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ Ġ"])
    w.add_token_types([1] * 256 + [3, 3, 3] + [1])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_pad_token_id(258)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(s) for s in reversed(list(t.shape))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
