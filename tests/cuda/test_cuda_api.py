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


# ---- weights on CUDA: the ops dispatch to the Triton kernels, outputs equal the CPU's --------
def _no_slow_path_warning():
    import warnings

    return warnings.catch_warnings(record=True)


@pytest.mark.parametrize("bits,act_bits", [(2, None), (3, None), (4, None), (8, None), (8, 8)])
def test_quantlinear_on_cuda_matches_the_cpu(bits, act_bits):
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]')")
    from lessmem.weights.qlinear import QuantLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96)
    w8a8 = act_bits == 8  # W8A8 takes symmetric per-row codes only
    q = QuantLinear.from_linear(lin, bits=bits, group_size=256 if w8a8 else 64, symmetric=w8a8,
                                act_bits=act_bits)
    x = torch.randn(3, 256)
    want = q(x)
    with _no_slow_path_warning() as caught:
        # int4pack (a CPU op's packing) becomes the portable layout; .to moves q itself
        g = q.to("cuda")
        got = g(x.cuda())
    assert got.device.type == "cuda" and g.layout in ("packed", "int8")
    assert not [w for w in caught if "fallback" in str(w.message)], [str(w.message) for w in caught]
    # the CPU's 2/3/4-bit kernel rounds activations to 16-bit fixed point, int4pack to bf16
    tol = 3e-2 if bits == 4 else 2e-3
    torch.testing.assert_close(got.cpu(), want, atol=tol * float(want.abs().max()), rtol=0)
    ref = x.cuda() @ g.dequantized_weight().T.cuda() + g.bias
    if act_bits is None:
        torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: prefill decodes the weight (torch.ops.lessmem.gguf_dequantize)
def test_gguf_linear_on_cuda_matches_the_cpu(qtype, rows):
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]')")
    from lessmem.weights.gguf_linear import GGUFLinear

    torch.manual_seed(1)
    q = GGUFLinear.from_linear(torch.nn.Linear(512, 80), qtype)
    x = torch.randn(rows, 512)
    want, want_w = q(x), q.dequantized_weight()
    g = q.to("cuda")  # (in place: q is g from here on)
    got = g(x.cuda())
    assert got.device.type == "cuda" and got.dtype == x.dtype
    assert torch.equal(g.dequantized_weight().cpu(), want_w)  # decoders bit-identical
    torch.testing.assert_close(got.cpu(), want, atol=2e-5 * float(want.abs().max()), rtol=0)
    y16 = g(x.cuda().half())  # fp16 activations: converted in the kernel, out in fp16
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float().cpu(), want, atol=2e-3 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("config", ["rtn4", "rtn3", "hqq4", "Q4_K_M", "Q8_0", "gptq4", "awq4", "smoothquant",
                                    "Q4_K_M-gptq"])
def test_quantize_a_model_on_cuda(config):
    import lessmem
    from lessmem.models import tiny_random

    model = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        intermediate_size=512).eval()
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = {"rtn4": lambda: lessmem.RTNConfig(bits=4, group_size=64),
           "rtn3": lambda: lessmem.RTNConfig(bits=3, group_size=64),
           "hqq4": lambda: lessmem.HQQConfig(bits=4, group_size=64),
           "Q4_K_M": lambda: lessmem.GGUFConfig("Q4_K_M"),
           "Q8_0": lambda: lessmem.GGUFConfig("Q8_0"),
           # calibrated: token ids, statistics and solves on the model's device
           "gptq4": lambda: lessmem.GPTQConfig(bits=4, group_size=64, n_samples=4, seq_len=64),
           "awq4": lambda: lessmem.AWQConfig(bits=4, group_size=64, n_samples=4, seq_len=64, n_grid=4),
           "smoothquant": lambda: lessmem.SmoothQuantConfig(n_samples=4, seq_len=64),
           "Q4_K_M-gptq": lambda: lessmem.GGUFConfig("Q4_K_M", gptq=True, n_samples=4, seq_len=64)}[config]
    calib = ({"calibration": torch.randint(3, 250, (4 * 64,), generator=torch.Generator().manual_seed(2))}
             if cfg().needs_calibration else {})
    cpu = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                      intermediate_size=512).eval()
    lessmem.quantize_(cpu, cfg(), progress=False, **calib)
    model.cuda()
    lessmem.quantize_(model, cfg(), progress=False, **calib)  # quantized where the weights are
    assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        got = model(ids.cuda()).logits.float().cpu()
        want = cpu(ids).logits.float()
        # one token at a time: the decode rows take the fused kernels
        step = model(ids[:, :1].cuda()).logits.float().cpu()
    def rel(a, b):
        return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())

    if calib:  # searches may settle on other near-equal points on another device: as good as the CPU's
        with torch.no_grad():
            flt = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                              intermediate_size=512).eval()(ids).logits.float()
        assert rel(got, flt) <= 1.5 * rel(want, flt) + 1e-3, (rel(got, flt), rel(want, flt))
        want = got
    assert rel(got, want) < 2e-2, rel(got, want)
    torch.testing.assert_close(step, want[:, :1], atol=0.05 * float(want.abs().max()), rtol=0)


def test_tiered_cache_on_cuda_with_a_host_tier_is_bit_exact():
    from lessmem.kvcache import KVCache, enable
    from lessmem.kvcache.tiered import TieredKVCache
    from lessmem.models import tiny_random
    from lessmem.offload import HostTier

    model = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        intermediate_size=256).cuda().eval()
    ids = torch.randint(3, 250, (1, 300), generator=torch.Generator().manual_seed(4)).cuda()
    with enable(model):
        mem = KVCache(model.config, "best-4")
        a = _logits(model, ids, mem, chunks=(256,))
        tiered = TieredKVCache(model.config, "best-4", tiers=[HostTier(None)], block_tokens=64, model=model)
        b = _logits(model, ids, tiered, chunks=(256,))
        tiered.set_device_budget(tiered.device_bytes() // 3)  # most blocks go to pinned host memory
        nxt = b[:, -1:].argmax(-1)
        for _ in range(4):
            la = model(input_ids=nxt, **{_kw(model): mem}, use_cache=True).logits
            lb = model(input_ids=nxt, **{_kw(model): tiered}, use_cache=True).logits
            assert torch.equal(la, lb)
            nxt = la[:, -1:].argmax(-1)
    assert torch.equal(a, b)
    assert tiered.memory()["tiers"]["host"] > 0


def _kw(model):
    from lessmem.kvcache.cache import cache_kwarg

    return cache_kwarg(model)


def test_bench_gpu_quick_on_cuda(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["header"]["cuda"] is True
    errors = [r for r in data["gemv"] for v in r.values() if isinstance(v, dict) and "error" in v]
    assert not errors, errors


@pytest.mark.parametrize("preset", ["int8", "int4", "kivi-4", "kivi-2", "best-4", "fp8"])
def test_store_kernel_on_cuda_equals_codec_encode(preset):
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]')")
    from lessmem.kvcache.codec import encode
    from lessmem.kvcache.presets import resolve
    from lessmem.kvcache.store_triton import encode as store

    cfg = resolve(preset)
    x = torch.randn(2, 4, 256, 64, device="cuda") * 3
    x[0, 1, :, 5] *= 40  # an outlier channel
    for spec in (cfg.keys, cfg.values):
        want, got = encode(x, spec), store(x, spec)  # codec's torch ops on CUDA vs one launch
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
        assert (got.zero_point is None) == (want.zero_point is None)
        if want.zero_point is not None:
            assert torch.equal(got.zero_point, want.zero_point)
