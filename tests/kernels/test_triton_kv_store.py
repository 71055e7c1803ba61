"""The Triton KV store kernel (kvcache/store_triton.py) against ``codec.encode``, run on
CPU tensors under Triton's interpreter.

The interpreter runs in one child process for the whole module (``_triton_interpret``:
triton fixes its mode at import, so this process stays normal). Every case is a chunk
with an all-zero group, a large outlier, a group of tiny values (int/uint scales clamp at
the fp16 floor; fp8/lm scales underflow to 0) and an all-negative group. int, uint and fp8
must match bit for bit (codes, scale, zero point). lm needs a float32 sum of squares whose
order is torch's own, so its fp16 scale may be one ulp off in a few groups (at most 1% of
them here); everywhere the scale matches, the codes must too.

Torch divides a tensor by a Python number as ``a / b`` on the CPU and as ``a · fp32(1/b)``
on CUDA; the kernel follows x's device. Its CUDA choice is checked here too: on inputs
built so that the two roundings store different scales, against ``codec.encode`` run
with CUDA's division (``_cuda_division``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]'); "
                                     "the Triton kernels are tested under its interpreter")

from _triton_interpret import run_interpreted  # noqa: E402

from lessmem.formats import PerGroup, PerToken  # noqa: E402
from lessmem.formats.integer import _store  # noqa: E402
from lessmem.kvcache import codec  # noqa: E402
from lessmem.kvcache.config import KVTensorConfig  # noqa: E402
from lessmem.kvcache.presets import resolve  # noqa: E402

TARGET = "lessmem.kvcache.store_triton:_encode"
PRESETS = ["int8", "int4", "kivi-4", "kivi-2", "best-4", "best-3", "best-2"]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _x(seed, B, H, T, D, tg=1, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * (torch.rand(B, H, T, 1, generator=g) * 3 + 0.1)
    x[0, 0, :tg] = 0.0  # all-zero groups (per token and per channel)
    x[0, -1, :tg] *= 1e-6  # tiny groups
    x[-1, 0, T - tg:] = -x[-1, 0, T - tg:].abs()  # all-negative groups
    x[-1, -1, T // 2, D // 3] = 250.0  # an outlier
    return x.to(dtype)


def _case(seed, spec, B, H, T, D, dtype=F32, packing=None, **kw):
    x = _x(seed, B, H, T, D, spec.group_shape(D)[0], dtype)
    lay = None if packing is None else dataclasses.replace(codec.kv_layout(spec, D), packing=packing)
    return x, spec, lay, kw


def _t(fmt, bits, gran=None, clip=1.0):
    return KVTensorConfig(fmt, bits, gran if gran is not None else PerToken(), clip)


CH, TOK = (lambda n: PerGroup(n, axis=-2)), (lambda n: PerGroup(n, axis=-1))
CASES = {}
for i, name in enumerate(PRESETS):
    for side in ("keys", "values"):
        CASES[f"preset-{name}-{side}"] = _case(i, getattr(resolve(name), side), 1 + i % 2, 2, 128, 64)
CASES.update({
    "int2-token-clip": _case(20, _t("int", 2, clip=0.9), 2, 2, 32, 64),
    "int3-g16-f16": _case(21, _t("int", 3, TOK(16)), 1, 2, 32, 64, F16),  # stream, a group = 2 octets
    "uint3-ch32-clip": _case(22, _t("uint", 3, CH(32), 0.95), 2, 2, 64, 64),
    "int4-ch64-bf16": _case(23, _t("int", 4, CH(64)), 1, 2, 128, 64, BF16),
    "uint8-g32-clip": _case(24, _t("uint", 8, TOK(32), 0.9), 2, 2, 32, 64),
    "int8-ch32": _case(25, _t("int", 8, CH(32)), 1, 2, 64, 64),
    "uint2-g8": _case(26, _t("uint", 2, TOK(8)), 1, 2, 32, 64),  # split, 2 groups a slot
    "uint2-g32": _case(27, _t("uint", 2, TOK(32)), 1, 2, 32, 64),  # split, a group = 2 slots
    "uint4-g1": _case(28, _t("uint", 4, TOK(1)), 1, 2, 32, 64),  # one element a group
    "uint2-ch48": _case(29, _t("uint", 2, CH(48)), 1, 2, 96, 64),  # a token group not a power of 2
    "uint4-token-d128-clip": _case(30, _t("uint", 4, clip=0.9), 2, 2, 32, 128),
    "int3-token-d128": _case(31, _t("int", 3), 1, 2, 32, 128),
    "uint4-ch128-d128-f16": _case(32, _t("uint", 4, CH(128)), 1, 2, 128, 128, F16),
    "uint4-token-d96": _case(33, _t("uint", 4), 1, 2, 32, 96),  # head_dim not a power of 2
    "int3-ch32-d96": _case(34, _t("int", 3, CH(32)), 1, 2, 64, 96),
    "uint2-g24-d96": _case(35, _t("uint", 2, TOK(24)), 1, 2, 32, 96),
    "uint4-token-stream": _case(36, _t("uint", 4), 1, 2, 32, 64, packing="stream"),
    "int2-ch32-stream": _case(37, _t("int", 2, CH(32)), 1, 2, 64, 64, packing="stream"),
    "uint4-ch128-d128-tiled": _case(38, _t("uint", 4, CH(128)), 1, 2, 128, 128, tile=1024),
    "int3-ch32-tiled": _case(39, _t("int", 3, CH(32)), 1, 2, 64, 64, tile=256),
    "fp8-e4m3-token": _case(40, _t("fp8-e4m3", 8), 2, 2, 32, 64),
    "fp8-e4m3-ch32-clip-f16": _case(41, _t("fp8-e4m3", 8, CH(32), 0.9), 1, 2, 64, 64, F16),
    "fp8-e5m2-g16-f16": _case(42, _t("fp8-e5m2", 8, TOK(16)), 2, 2, 32, 64, F16),
    "fp8-e5m2-ch32-d128": _case(43, _t("fp8-e5m2", 8, CH(32)), 1, 2, 64, 128),
    "lm2-g32": _case(44, _t("lm", 2, TOK(32)), 2, 2, 64, 64),
    "lm4-ch32-clip": _case(45, _t("lm", 4, CH(32), 0.9), 1, 2, 64, 64),
    "lm3-token-d128-bf16": _case(46, _t("lm", 3), 2, 2, 32, 128, BF16),
})


def _ties_case(seed, spec, B=1, H=2, T=32, D=64):
    """Per-token rows whose scale is a chosen fp16 s (the row's extremes give exactly s)
    and whose other values are exact ties of x / s: halves between two codes (int, uint)
    or midpoints between two fp8 values (and, in odd uint rows, the zero point is one).
    Round-half-to-even, the exact division and torch's fp8 rounding each decide them."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.rand(B, H, T, 1, generator=g) * 2 + 0.01).half().float()
    if spec.format in ("int", "uint"):
        qmax = 2 ** (spec.bits - 1) - 1 if spec.format == "int" else 2**spec.bits - 1
        z = 0 if spec.format == "int" else qmax // 3  # zero point: the row spans [-z·s, (qmax - z)·s]
        lo, hi = (-qmax, qmax) if spec.format == "int" else (-z, qmax - z)
        k = torch.randint(lo, hi, (B, H, T, D), generator=g).float() + 0.5
        k[..., 0], k[..., 1] = hi, lo
        if spec.format == "uint":  # odd rows: the zero point is the tie (-lo / s = z + 1/2)
            k[:, :, 1::2] -= 0.5
    else:
        dtype = codec._FP8[spec.format]
        v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        v = v[torch.isfinite(v)].unique()
        mid = (v[1:] + v[:-1]) / 2  # exact: a few significant bits
        k = mid[torch.randint(0, mid.numel(), (B, H, T, D), generator=g)]
        k[..., 0] = torch.finfo(dtype).max
    return k * s, spec, None, {}  # k · s is exact in fp32


CASES.update({f"ties-{spec.format}{spec.bits}": _ties_case(70 + i, spec) for i, spec in enumerate(
    [_t("int", 4), _t("int", 2), _t("uint", 3), _t("uint", 8), _t("fp8-e4m3", 8), _t("fp8-e5m2", 8)])})
# a non-contiguous chunk: tokens 16..79 of heads 1..2 of a [B, T, H, D] buffer seen as [B, H, T, D]
_buf = _x(50, 1, 4, 128, 64).transpose(1, 2).contiguous().transpose(1, 2)
CASES["strided-kivi-2-keys"] = (_buf[:, 1:3, 16:80], resolve("kivi-2").keys, None, {})
CASES["strided-int4-values"] = (_buf[:, 1:3, 16:80], resolve("int4").values, None, {})


@contextlib.contextmanager
def _cuda_division():
    """``tensor / number`` as torch computes it on CUDA: ``tensor · fp32(1 / number)``; the
    codec's torch ops then run as on CUDA (its C++ loop, a CPU path, is switched off)."""
    div = torch.Tensor.__truediv__

    def recip(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self * float(np.float32(1.0) / np.float32(other))
        return div(self, other)

    torch.Tensor.__truediv__ = recip
    cpp, codec._affine_cpp = codec._affine_cpp, lambda: None
    try:
        yield
    finally:
        torch.Tensor.__truediv__ = div
        codec._affine_cpp = cpp


def _division_case(seed, spec, B, H, T, D):
    """x whose groups have maxima (and, for uint, minimum 0) where the CPU's and CUDA's
    division by qmax / fmax store different fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    q = {"int": 2 ** (spec.bits - 1) - 1, "uint": 2**spec.bits - 1}.get(spec.format)
    q = q if q is not None else float(torch.finfo(torch.float8_e4m3fn).max)
    v = torch.rand(400000, generator=g) * 8 + 0.01
    with _cuda_division():
        cuda = v / q
    cpu = v / q
    if spec.format == "uint":
        cuda, cpu = _store(cuda, torch.float16, round_up=True), _store(cpu, torch.float16, round_up=True)
    else:
        cuda, cpu = cuda.half(), cpu.half()
    v = v[cuda != cpu]
    tg, dg = spec.group_shape(D)
    n = B * H * (T // tg) * (D // dg)
    vg = v[torch.arange(n) % v.numel()].view(B, H, T // tg, D // dg)
    vg = vg.repeat_interleave(tg, 2).repeat_interleave(dg, 3)
    u = torch.rand(B, H, T, D, generator=g)
    first = (torch.arange(T) % tg == 0)[:, None] & (torch.arange(D) % dg == 0)[None, :]
    return torch.where(first, 1.0, u) * vg  # each group's max is its v, its min >= 0


DIVISION = {"cuda-div-int8": _division_case(60, _t("int", 8), 1, 2, 32, 64),
            "cuda-div-uint4": _division_case(61, _t("uint", 4), 1, 2, 32, 64),
            "cuda-div-uint3-ch32": _division_case(62, _t("uint", 3, CH(32)), 1, 2, 64, 64),
            "cuda-div-fp8": _division_case(63, _t("fp8-e4m3", 8), 1, 2, 32, 64)}
DIVISION_SPECS = {"cuda-div-int8": _t("int", 8), "cuda-div-uint4": _t("uint", 4),
                  "cuda-div-uint3-ch32": _t("uint", 3, CH(32)), "cuda-div-fp8": _t("fp8-e4m3", 8)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    calls = {name: (TARGET, (x, spec, lay), kw) for name, (x, spec, lay, kw) in CASES.items()}
    for name, x in DIVISION.items():
        calls[name] = (TARGET, (x, DIVISION_SPECS[name]), {"recip": True})
        calls[name + "-cpu"] = (TARGET, (x, DIVISION_SPECS[name]), {"recip": False})
    calls["empty"] = (TARGET, (torch.zeros(1, 2, 0, 64), resolve("kivi-4").keys), {})
    return run_interpreted(calls, tmp_path_factory.mktemp("triton"))


def _equal(out, ref):
    for part in ("codes", "scale", "zero_point"):
        a, b = getattr(out, part), getattr(ref, part)
        assert (a is None) == (b is None), part
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (part, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), f"{part}: {(a != b).sum().item()} of {a.numel()} differ"


def _close_lm(out, ref, lay):
    """lm: scales within one fp16 ulp in <= 1% of the groups; equal codes where they match."""
    assert out.zero_point is None and ref.zero_point is None
    assert out.codes.shape == ref.codes.shape and out.scale.shape == ref.scale.shape
    same = out.scale == ref.scale
    assert (~same).float().mean() <= 0.01, f"{(~same).sum().item()} of {same.numel()} scales differ"
    ulps = (out.scale[~same].view(torch.int16).int() - ref.scale[~same].view(torch.int16).int()).abs()
    assert torch.all(ulps == 1), ulps
    T = out.codes.shape[2]
    keep = same.repeat_interleave(lay.token_group, 2)[:, :, :T].repeat_interleave(lay.channel_group, 3)
    assert torch.equal(lay.unpack(out.codes)[keep], lay.unpack(ref.codes)[keep])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_codec(results, name):
    x, spec, lay, _ = CASES[name]
    res = results[name]
    assert res[0] == "ok", res
    ref = codec.encode(x, spec, lay)
    if spec.format == "lm":
        _close_lm(res[1], ref, lay or codec.kv_layout(spec, x.shape[-1]))
    else:
        _equal(res[1], ref)


@pytest.mark.parametrize("name", list(DIVISION))
def test_cuda_division_matches_codec_on_cuda(results, name):
    x, spec = DIVISION[name], DIVISION_SPECS[name]
    with _cuda_division():
        cuda = codec.encode(x, spec)
    cpu = codec.encode(x, spec)
    assert not torch.equal(cuda.scale, cpu.scale)  # the case tells the two divisions apart
    assert results[name][0] == "ok" and results[name + "-cpu"][0] == "ok"
    _equal(results[name][1], cuda)
    _equal(results[name + "-cpu"][1], cpu)


def test_empty_chunk(results):
    status, enc = results["empty"]
    assert status == "ok"
    _equal(enc, codec.encode(torch.zeros(1, 2, 0, 64), resolve("kivi-4").keys))


def test_every_codec_format_is_supported():
    from lessmem.kvcache.store_triton import SUPPORTED_FORMATS

    assert set(SUPPORTED_FORMATS) == set(codec.FORMATS)


@pytest.mark.parametrize("x, spec, layout, err, match", [
    (torch.zeros(2, 32, 64), _t("uint", 4), None, ValueError,
     r"x is a 3-D torch.float32 tensor; allowed: a 4-D \[B, H, T, D\] tensor of float32, float16, bfloat16"),
    (torch.zeros(1, 2, 32, 64, dtype=torch.float64), _t("uint", 4), None, ValueError, "torch.float64 tensor; allowed"),
    ([[1.0]], _t("uint", 4), None, ValueError, "x is a list; allowed"),
    (torch.zeros(1, 2, 48, 64), _t("uint", 4, CH(32)), None, ValueError,
     "chunk of 48 tokens; allowed: a multiple of the token group 32"),
    (torch.zeros(1, 2, 32, 60), _t("int", 3), None, ValueError, "head_dim=60 does not fit int3"),
    (torch.zeros(1, 2, 32, 64), _t("uint", 4), codec.kv_layout(_t("uint", 4), 128), ValueError,
     "x has head_dim 64, layout .* head_dim 128; allowed: the same"),
    (torch.zeros(1, 2, 32, 64), _t("uint", 4), codec.kv_layout(_t("uint", 2), 64), ValueError,
     "does not store format uint4"),
    (torch.zeros(1, 2, 32, 64), KVTensorConfig("none", 16), None, ValueError, "stored in full precision"),
    (torch.zeros(1, 2, 32, 96), _t("uint", 4, TOK(32)), None, NotImplementedError,
     "does not take layout .*channel groups of 32 over a split packing of 48 channels"),
])
def test_bad_arguments_are_refused_by_name(x, spec, layout, err, match):
    from lessmem.kvcache.store_triton import encode

    with pytest.raises(err, match=match):
        encode(x, spec, layout)


def test_a_format_the_kernel_does_not_know_is_refused_by_name():
    from lessmem.kvcache.store_triton import encode

    spec = _t("uint", 4)
    object.__setattr__(spec, "format", "nf4")  # a format added to codec.FORMATS later
    with pytest.raises(NotImplementedError, match="does not take format 'nf4'; allowed: int, uint, lm"):
        encode(torch.zeros(1, 2, 32, 64), spec)


def test_cpu_tensors_without_the_interpreter_are_refused():
    from lessmem.kvcache import store_triton as kv_store_triton

    if kv_store_triton.interpreting():
        pytest.skip("this process runs under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors \(x is on cpu\).*TRITON_INTERPRET=1"):
        kv_store_triton.encode(torch.zeros(1, 2, 32, 64), resolve("int4").keys)
