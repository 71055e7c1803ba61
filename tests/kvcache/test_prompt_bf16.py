"""Prompt chunks attend in bfloat16 where the layer's linears multiply prompts in bfloat16.

``GGUFLinear.bf16_prompt_rows`` (int8 activations on a CPU with AMX-BF16 or AVX512-BF16)
makes a prompt chunk's linears multiply bf16 copies; ``lessmem_attention`` then gives that
chunk's attention bf16 q, k and v too (``view.PROMPT_BF16``), with a DynamicCache and over a
quantized cache's history alike. Decode rows, models without the flag and the evaluation (which switches int8
activations off) keep float32. ``BF16_PROMPT_ROWS`` is patched on so this runs on any CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import lessmem.weights.gguf_linear as gl
from lessmem.kernels import prompt_attention as PA
from lessmem.kvcache import KVCache, enable
from lessmem.kvcache import view as V
from lessmem.models import tiny_random
from lessmem.weights.gguf_export import write_model_gguf
from lessmem.weights.gguf_linear import set_int8_activations
from lessmem.weights.gguf_load import load_gguf_blocks


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    torch.manual_seed(0)
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    path = write_model_gguf(m, tmp_path_factory.mktemp("bf16") / "m.gguf", "q8_0")
    return load_gguf_blocks(path, config=m.config)  # int8 activations on, as lessmem.load


def _run(model, kind, ids, spy):
    """Three prompt chunks of 40 rows, then two decode steps; the logits and, per forward,
    whether any attention call took bf16 inputs."""
    cache = DynamicCache() if kind == "dynamic" else KVCache(model.config, kind)
    logits, low = [], []
    with torch.no_grad(), enable(model):
        for s in range(0, 120, 40):
            spy.clear()
            logits.append(model(ids[:, s:s + 40], past_key_values=cache).logits)
            low.append(any(spy))
        nxt = logits[-1][:, -1:].argmax(-1)
        for _ in range(2):
            spy.clear()
            logits.append(model(nxt, past_key_values=cache).logits)
            low.append(any(spy))
            nxt = logits[-1][:, -1:].argmax(-1)
    assert V.PROMPT_BF16.get() is False  # reset after every forward
    return logits, low


@pytest.mark.parametrize("kind", ["dynamic", "best-4"])
def test_prompt_chunks_attend_in_bf16_decode_rows_in_float32(blocks, kind, monkeypatch):
    spy: list[bool] = []  # per attention call: were its inputs bf16?
    sdpa = F.scaled_dot_product_attention

    def sdpa_spy(q, *a, **kw):  # transformers' SDPA path and view._sdpa_gqa
        spy.append(q.dtype == torch.bfloat16)
        return sdpa(q, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_spy)
    orig_fp = V._fp_attention

    def fp_spy(q, k, v, mask, scaling, causal=False):  # the flash-attention calls with a log-sum-exp
        spy.append(V._bf16(q, k, v, mask) is not None)
        return orig_fp(q, k, v, mask, scaling, causal)

    monkeypatch.setattr(V, "_fp_attention", fp_spy)
    kernel = PA.bf16_attention

    def kernel_spy(q, *a, **kw):  # the bf16 dot-product kernel (CPUs with AVX512-BF16) is bf16 too
        spy.append(True)
        return kernel(q, *a, **kw)

    monkeypatch.setattr(PA, "bf16_attention", kernel_spy)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(1))

    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", False)
    ref, low = _run(blocks, kind, ids, spy)
    assert low == [False] * 5
    monkeypatch.setattr(gl, "BF16_PROMPT_ROWS", True)
    got, low = _run(blocks, kind, ids, spy)
    assert low == [True, True, True, False, False]  # the chunks, not the decode rows
    for a, b in zip(got[:3], ref[:3], strict=True):
        assert not torch.equal(a, b)
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
    set_int8_activations(blocks, False)  # what the evaluation does: float32 everywhere
    try:
        plain, low = _run(blocks, kind, ids, spy)
    finally:
        set_int8_activations(blocks, True)
    assert low == [False] * 5
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], ref[:3], strict=True))  # decode rows: float32 too
