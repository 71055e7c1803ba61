"""The public API end to end on CUDA (skipped without a GPU): the Triton attention kernel
against the reference, the op's dispatch, and a best-4 KVCache on a tiny real model
against DynamicCache and against the same cache on the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PRESETS = ["int8", "int4", "kivi-4", "kivi-2", "best-4", "best-3", "best-2", "fp8"]


def _history(preset, B=2, Hkv=2, T=640, D=64, device="cuda", seed=0):
    from lessmem.kernels.attention import QuantKV, QuantSide
    from lessmem.kvcache.codec import encode, kv_layout
    from lessmem.kvcache.presets import resolve

    cfg = resolve(preset)
    g = torch.Generator().manual_seed(seed)
    sides = []
    for spec in (cfg.keys, cfg.values):
        enc = encode(torch.randn(B, Hkv, T, D, generator=g).to(device), spec)
        sides.append(QuantSide(enc.codes, enc.scale, enc.zero_point, kv_layout(spec, D)))
    return QuantKV(*sides)


def _cpu(kv):
    from lessmem.kernels.attention import QuantKV, QuantSide

    def side(s):
        return QuantSide(s.codes.cpu(), s.scale.cpu(), None if s.zero_point is None else s.zero_point.cpu(),
                         s.layout)
    return QuantKV(side(kv.keys), side(kv.values))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("Tq", [1, 3])
def test_triton_kernel_matches_reference_on_cuda(preset, Tq):
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]')")
    from lessmem.kernels.attention_reference import attention_reference
    from lessmem.kernels.attention_triton import triton_attention

    kv = _history(preset)
    q = torch.randn(2, 8, Tq, 64, device="cuda") * 0.3
    mask = torch.zeros(2, Tq, kv.n_tokens, device="cuda")
    mask[1, :, :100] = float("-inf")
    out, lse = triton_attention(q, kv, mask)
    ref, ref_lse = attention_reference(q.cpu(), _cpu(kv), mask.cpu())
    tol = 2e-5 * float(ref.abs().max()) + 1e-6
    assert float((out.cpu() - ref).abs().max()) <= tol
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)


def test_quantized_attention_on_cuda_dispatches_to_triton():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]')")
    from lessmem.kernels.attention import quantized_attention
    from lessmem.kernels.attention_triton import triton_attention

    kv = _history("best-4", T=4096)
    q = torch.randn(2, 8, 1, 64, device="cuda") * 0.3
    out, lse = quantized_attention(q, kv)
    assert out.device.type == "cuda" and lse.device.type == "cuda"
    o2, l2 = triton_attention(q, kv)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


def _logits(model, ids, cache, chunks=(100, 1, 1, 33, 1, 40, 1)):
    from lessmem.kvcache.cache import cache_kwarg

    out, s = [], 0
    sizes = list(chunks) + [ids.shape[1] - sum(chunks)]
    with torch.no_grad():
        for n in sizes:
            r = model(input_ids=ids[:, s:s + n], **{cache_kwarg(model): cache}, use_cache=True)
            out.append(r.logits.float())
            s += n
    return torch.cat(out, dim=1)


def test_best4_kvcache_on_cuda_against_dynamic_cache():
    from transformers import DynamicCache

    from lessmem.kvcache import KVCache, enable
    from lessmem.models import tiny_random

    torch.manual_seed(0)
    model = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        intermediate_size=256).eval()
    ids = torch.randint(3, 250, (2, 300), generator=torch.Generator().manual_seed(3))
    errs = {}
    for device in ("cpu", "cuda"):
        model.to(device)
        x = ids.to(device)
        dyn = _logits(model, x, DynamicCache())
        with enable(model):
            got = _logits(model, x, KVCache(model.config, "best-4"))
        assert got.device.type == device
        errs[device] = float(((got - dyn).pow(2).mean() / dyn.pow(2).mean()).cpu())
    # the same 4-bit cache on both devices: as close to DynamicCache on CUDA as on the CPU
    assert errs["cuda"] < 0.05
    assert errs["cuda"] < 2 * errs["cpu"] + 1e-4, errs
