"""FP8Linear on CUDA (skipped without a GPU): the ``torch._scaled_mm`` path against the W8A8
math done in float32 on the CPU, and the one-time fallback where the GPU or the shape
cannot take it. (Not against the CPU layer itself: on torch 2.11 the CPU ``_scaled_mm``
takes per-tensor scales only, so that layer falls back to weight-only and differs by the
activation rounding, 2.6% on the H200 run of 2026-12-04.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lessmem.weights.fp8 import FP8Linear, quantize_activations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _fp8_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _layer(k, n, act, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return FP8Linear.from_linear(torch.nn.Linear(k, n), act=act)


def w8a8_reference(layer, x):
    """What _scaled_mm computes, in float32: FP8 activations (per-row scales) times W_hat."""
    xq, sx = quantize_activations(x.float())
    return F.linear(xq.float() * sx, layer.dequantized_weight(), layer.bias)


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_w8a8_cuda_matches_cpu(dtype, rows):
    cpu = _layer(512, 256, "fp8")
    gpu = _layer(512, 256, "fp8").to("cuda")
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = gpu(x.cuda())
    assert y.dtype == dtype and y.shape == (rows, 256)
    if _fp8_gpu():
        assert gpu.fallback_reason is None and not caught  # the FP8 tensor cores ran
        # the same FP8 operands; only accumulation order (and a bf16 output on SM 8.9) differ
        assert rel_rms(y.cpu(), w8a8_reference(cpu, x)) < 1e-2
    else:
        assert "compute capability >= 8.9" in gpu.fallback_reason and len(caught) == 1
        assert rel_rms(y.cpu(), F.linear(x.float(), cpu.dequantized_weight(), cpu.bias).to(dtype)) < 1e-2


def test_weight_only_cuda_matches_cpu():
    cpu, gpu = _layer(512, 256, None), _layer(512, 256, None).to("cuda")
    x = torch.randn(8, 512)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-4, atol=1e-4)
    assert gpu.qweight.dtype == torch.float8_e4m3fn and gpu.scale.dtype == torch.float32


def test_odd_shapes_fall_back_once():
    gpu = _layer(72, 40, "fp8").to("cuda")  # not multiples of 16
    x = torch.randn(3, 72, device="cuda")
    with pytest.warns(UserWarning, match="weight-only FP8 path"):
        y = gpu(x)
    assert gpu.fallback_reason is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(gpu(x), y)
    torch.testing.assert_close(y, F.linear(x, gpu.dequantized_weight(), gpu.bias))


def test_move_back_to_cpu_tries_scaled_mm_again():
    layer = _layer(64, 32, "fp8").to("cuda")
    layer(torch.randn(2, 64, device="cuda"))
    layer.to("cpu")
    assert layer.fallback_reason is None  # nothing learnt on the GPU is carried over
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer(torch.randn(2, 64))
    # the CPU's own answer: _scaled_mm ran, or this torch's CPU kernel refused row-wise scales
    assert layer.fallback_reason is None or "torch._scaled_mm raised" in layer.fallback_reason
