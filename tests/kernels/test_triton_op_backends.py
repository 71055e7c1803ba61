"""The CUDA backends of the linear torch ops (``linear_ops._*_cuda``),
glue and all, run on CPU tensors under Triton's interpreter and compared with the ops'
CPU results: the reshapes, dtypes, bias, int8 activations and the fallbacks they wrap
around the Triton kernels are what runs on a GPU, so they are checked here too.

Tolerances: the CPU's 2/3/4-bit kernel rounds activations to 16-bit fixed point (relative
error ~1.6e-5) where Triton uses them as given, hence 1e-4·max|y|; GGUF and int8 sum the
same float32 weights in another order (1e-5·max|y|); w8a8 sums are exact integers and the decoders bit-identical.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]'); "
                                     "the Triton kernels are tested under its interpreter")

from _triton_interpret import run_interpreted  # noqa: E402

from lessmem.formats.gguf import gguf_type, quantize_gguf  # noqa: E402
from lessmem.formats.packing import pack_bits  # noqa: E402
from lessmem.kernels import linear_ops  # noqa: E402,F401  (registers the ops)

OPS = torch.ops.lessmem
LIN = "lessmem.kernels.linear_ops"


def _cases():
    g = torch.Generator().manual_seed(0)
    cases = {}
    for bits in (2, 3, 4):
        n, k, gs = 24, 128, 32
        u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
        scale = (torch.rand(n, k // gs, generator=g) * 0.05 + 0.01).half()
        zero = torch.randint(0, 2**bits, (n, k // gs), dtype=torch.uint8, generator=g)
        x = torch.randn(2, 3, k, generator=g)  # leading dims, as a layer sees them
        args = (x, pack_bits(u, bits), bits, scale, zero, gs, torch.randn(n, generator=g))
        cases[f"lowbit{bits}"] = (f"{LIN}:_lowbit_cuda", args, OPS.lowbit_linear(*args), 1e-4)
    w = torch.randint(-127, 128, (24, 96), dtype=torch.int8, generator=g)
    s = (torch.rand(24, generator=g) / 50 + 1e-3).half()
    x = torch.randn(1, 2, 96, generator=g)
    cases["int8"] = (f"{LIN}:_int8_cuda", (x, w, s), OPS.int8_linear(x, w, s), 1e-5)
    xq = torch.randint(-127, 128, (3, 96), dtype=torch.int8, generator=g)
    sx = torch.rand(3, generator=g)
    cases["w8a8"] = (f"{LIN}:_w8a8_cuda", (xq, sx, w, s), OPS.w8a8_linear(xq, sx, w, s), 1e-6)
    for qtype, int8_act in (("q4_0", True), ("q4_1", False), ("q4_k", False), ("q6_k", False), ("q8_0", True)):
        t = gguf_type(qtype)
        raw = torch.from_numpy(quantize_gguf(torch.randn(20, 256, generator=g), qtype)).view(20, -1)
        x = torch.randn(1, 3, 256, generator=g)
        bias = torch.randn(20, generator=g)
        args = (x, raw, t.ggml_id, 20, bias, int8_act)
        cases[f"gguf-{qtype}{'-q8act' if int8_act else ''}"] = (f"{LIN}:_gguf_cuda", args, OPS.gguf_linear(*args), 1e-5)
        dargs = (raw, t.ggml_id, 20, 256)
        cases[f"dequant-{qtype}"] = (f"{LIN}:_gguf_dequantize_cuda", dargs, OPS.gguf_dequantize(*dargs), 0.0)
    x16 = torch.randn(2, 256, generator=g).half()
    t = gguf_type("q4_k")
    raw = torch.from_numpy(quantize_gguf(torch.randn(20, 256, generator=g), "q4_k")).view(20, -1)
    args = (x16, raw, t.ggml_id, 20, None, False)
    cases["gguf-q4_k-fp16"] = (f"{LIN}:_gguf_cuda", args, OPS.gguf_linear(*args), 2e-3)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    calls = {name: (target, args, {}) for name, (target, args, _, _) in CASES.items()}
    return run_interpreted(calls, tmp_path_factory.mktemp("op_backends"))


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_backend_matches_the_cpu_op(name, results):
    status, *rest = results[name]
    assert status == "ok", rest
    got, want, tol = rest[0], CASES[name][2], CASES[name][3]
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if tol == 0.0:
        assert torch.equal(got, want)
    else:
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max()) + 1e-6
