"""GGUF blocks written by llama.cpp itself: the built-in SmolLM2-135M Q4_1 file."""

from __future__ import annotations

import numpy as np
import pytest

from lessmem.formats.gguf import GGUF_TYPES, dequantize_gguf, quantize_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def reader():
    from lessmem.base.paths import cache_dir

    path = cache_dir("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():  # fetch (and sha256-check) it the way lessmem.load does
        from lessmem.models import builtin_gguf

        path = builtin_gguf("smollm2-135m")
    return gguf.GGUFReader(path)


@pytest.mark.model
def test_llama_cpp_blocks_decode_like_gguf_and_requantize_to_the_same_bytes(reader):
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        if name not in GGUF_TYPES or not t.name.startswith(("token_embd", "blk.0.", "blk.29.")):
            continue
        seen.add((name, t.name))
        spec = GGUF_TYPES[name]
        raw = np.asarray(t.data)[:2048]  # the first 2048 rows of each (embeddings: 49152)
        shape = (raw.shape[0], raw.shape[1] // spec.type_size * spec.block_size)
        ours = dequantize_gguf(raw, name, shape)
        theirs = gguf.quants.dequantize(raw, t.tensor_type)
        assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32)), t.name
        # llama.cpp's blocks are a fixed point of our quantizer: decode, encode, same bytes
        assert np.array_equal(quantize_gguf(ours, name), raw), t.name
    assert ("q8_0", "token_embd.weight") in seen and len(seen) == 15
