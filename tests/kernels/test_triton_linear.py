"""The Triton dequant-matmuls (kernels/linear_triton.py) against the float64 oracles of
``linear_reference``, run on CPU tensors under Triton's interpreter.

The interpreter runs in one child process for the whole module (``_triton_interpret``:
triton fixes its mode at import, so this process stays normal). Oracles: ``lowbit_linear``
against ``x @ dequant_grouped_weight(u, scale, zero).T (+ bias)`` in float64 (the Triton
kernel uses the activations as given, so not ``lowbit_linear_ref``, which rounds them to
16-bit fixed point as the C++ kernel does); ``int8_linear`` against ``int8_linear_ref``;
``w8a8_linear`` against ``w8a8_linear_ref``.

Tolerances: lowbit and int8 (float32 products summed in another order than the oracle):
max |y − ref| ≤ 1e-5·max|ref| + 1e-5. w8a8 (the integer sums exact, then two float32
products): every |y − ref| ≤ 4e-7·|ref| (about 3 float32 roundings), and with unit scales
y equals the exact integer sums bit for bit.

Shapes: N = 40 (not a multiple of BLOCK_N), M in {1, 3, 17} (GEMV path, and tl.dot on a
partly filled 32-row tile), K = 160/192/256 for group sizes 32/64/128 and a 96-group. For
lowbit, BLOCK_K divides the group size, so K is always whole steps: the K tail is exercised
by int8/w8a8 (K = 100, 300, not multiples of BLOCK_K 64/128). Split-K, narrow BLOCK_N,
fp16/bf16 activations, strided rows of x and 2-D code buffers have their own cases.
Bad arguments are refused in this process, before any launch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]'); "
                                     "the Triton kernels are tested under its interpreter")

from _cases import lowbit_case  # noqa: E402
from _triton_interpret import run_interpreted  # noqa: E402

from lessmem.kernels import linear_reference as ref  # noqa: E402
from lessmem.kernels import linear_triton as lt  # noqa: E402

MOD = "lessmem.kernels.linear_triton"
N = 40
GROUPS = [(32, 160), (64, 192), (128, 256)]  # (group_size, K)


def _lowbit(bits, gs, k, m, bias, seed, xdtype=torch.float32, n=N):
    u, codes, scale, zero = lowbit_case(bits, n, k, gs, False, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g) if bias else None
    want = x.double() @ ref.dequant_grouped_weight(u, scale, zero, gs).T
    if b is not None:
        want = want + b.double()
    return (x, codes, bits, scale, zero, gs, b), want


def _int8(m, k, seed, xdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) / 50 + 1e-3).half()
    x = torch.randn(m, k, generator=g).to(xdtype)
    return (x, w, s), ref.int8_linear_ref(x.double(), w, s).double()


def _w8a8(m, k, seed, extreme=False, unit=False):
    g = torch.Generator().manual_seed(seed)
    if extreme:  # the largest sums int8 can make: |Σ| up to K·128·128
        xq = torch.where(torch.rand(m, k, generator=g) < 0.5, -128, 127).to(torch.int8)
        w = torch.where(torch.rand(N, k, generator=g) < 0.5, -128, 127).to(torch.int8)
        w[:, : k // 2] = xq[0, : k // 2]  # row 0 of xq agrees with every w in half its columns
    else:
        xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        w = torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=g)
    sx = torch.ones(m) if unit else torch.rand(m, generator=g) / 100 + 1e-4
    s = torch.ones(N, dtype=torch.float16) if unit else (torch.rand(N, generator=g) / 50 + 1e-3).half()
    return (xq, sx, w, s), ref.w8a8_linear_ref(xq, sx, w, s).double()


# name -> (function, args, kwargs, float64 reference, kind)
CASES: dict = {}
for bits in (2, 3, 4):
    for gs, k in GROUPS:
        for m in (1, 3, 17):
            bias = (bits + gs // 32 + m) % 2 == 0
            args, want = _lowbit(bits, gs, k, m, bias, seed=100 * bits + gs + m)
            CASES[f"lowbit-{bits}b-g{gs}-m{m}-{'bias' if bias else 'nobias'}"] = (
                "lowbit_linear", args, {}, want, "float")
for bits in (2, 3, 4):
    args, want = _lowbit(bits, 96, 192, 2, True, seed=7 + bits)  # BLOCK_K 32 in a 96-group
    CASES[f"lowbit-{bits}b-g96"] = ("lowbit_linear", args, {}, want, "float")
    args, want = _lowbit(bits, 32, 256, 3, True, seed=11 + bits)  # 8 steps in 3 splits; bias once
    CASES[f"lowbit-{bits}b-split3-bn8"] = ("_lowbit", args, {"split_k": 3, "block_n": 8}, want, "float")
args, want = _lowbit(4, 32, 256, 20, True, seed=13)
CASES["lowbit-dot-split2"] = ("_lowbit", args, {"split_k": 2, "block_n": 16}, want, "float")
for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    for m in (1, 17):
        args, want = _lowbit(3, 64, 192, m, True, seed=17 + m, xdtype=dt)
        CASES[f"lowbit-x{name}-m{m}"] = ("lowbit_linear", args, {}, want, "float")
# rows of x strided (a column slice of a wider buffer), codes as [N, K·bits/8]
(x, codes, bits, scale, zero, gs, b), want = _lowbit(2, 64, 128, 3, False, seed=19)
wide = torch.zeros(3, 200)
wide[:, 8:136] = x
CASES["lowbit-strided-x-2d-codes"] = ("lowbit_linear", (wide[:, 8:136], codes.view(N, -1), bits, scale, zero,
                                                         gs, b), {}, want, "float")
args, want = _lowbit(4, 32, 64, 1, True, seed=23, n=5)  # fewer rows than any BLOCK_N
CASES["lowbit-n5"] = ("lowbit_linear", args, {}, want, "float")

for m in (1, 3, 17):
    args, want = _int8(m, 100, seed=m)
    CASES[f"int8-m{m}"] = ("int8_linear", args, {}, want, "float")
    args, want = _w8a8(m, 100, seed=m)
    CASES[f"w8a8-m{m}"] = ("w8a8_linear", args, {}, want, "int")
for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    args, want = _int8(2, 100, seed=5, xdtype=dt)
    CASES[f"int8-x{name}"] = ("int8_linear", args, {}, want, "float")
for m in (2, 17):
    args, want = _int8(m, 300, seed=30 + m)
    CASES[f"int8-m{m}-split3"] = ("_int8", args, {"split_k": 3}, want, "float")
    args, want = _w8a8(m, 300, seed=30 + m)
    CASES[f"w8a8-m{m}-split3"] = ("_w8a8", args, {"split_k": 3}, want, "int")
args, want = _w8a8(5, 1000, seed=3, extreme=True)
CASES["w8a8-extreme-sums"] = ("w8a8_linear", args, {}, want, "int")
for m in (1, 17):
    args, want = _w8a8(m, 1000, seed=4 + m, extreme=True, unit=True)
    CASES[f"w8a8-unit-scales-m{m}"] = ("w8a8_linear", args, {}, want, "exact")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    calls = {name: (f"{MOD}:{fn}", args, kwargs) for name, (fn, args, kwargs, _, _) in CASES.items()}
    x = torch.zeros(0, 64)
    calls["lowbit-m0"] = (f"{MOD}:lowbit_linear", (x, torch.zeros(N * 32, dtype=torch.uint8), 4,
                                                   torch.ones(N, 2).half(), torch.zeros(N, 2, dtype=torch.uint8),
                                                   32), {})
    return run_interpreted(calls, tmp_path_factory.mktemp("triton-linear"))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(results, name):
    _, _, _, want, kind = CASES[name]
    status, *res = results[name]
    assert status == "ok", res
    y = res[0]
    assert y.dtype == torch.float32 and y.shape == want.shape
    err = (y.double() - want).abs()
    if kind == "float":
        tol = 1e-5 * float(want.abs().max()) + 1e-5
        assert float(err.max()) <= tol, f"max |y - ref| = {float(err.max()):.3g} > {tol:.3g}"
    elif kind == "int":
        bad = err > 4e-7 * want.abs()
        assert not bad.any(), f"{int(bad.sum())} values off by more than 4e-7 relative; worst {float(err.max()):.3g}"
    else:  # unit scales: y is the exact integer sum
        assert torch.equal(y.double(), want)


def test_empty_batch_gives_an_empty_result(results):
    status, *res = results["lowbit-m0"]
    assert status == "ok", res
    assert res[0].shape == (0, N) and res[0].dtype == torch.float32


def _good_lowbit():
    (x, codes, bits, scale, zero, gs, b), _ = _lowbit(4, 32, 64, 1, True, seed=1, n=8)
    return dict(x=x, codes=codes, bits=bits, scale=scale, zero=zero, group_size=gs, bias=b)


def _bad_lowbit(**change):
    return lambda: lt.lowbit_linear(**{**_good_lowbit(), **change})


_W = torch.zeros(8, 64, dtype=torch.int8)
_S = torch.ones(8, dtype=torch.float16)
BAD = {
    "scale-dtype": (_bad_lowbit(scale=torch.ones(8, 2)),
                    r"lowbit_linear: scale dtype torch.float32; allowed: torch.float16"),
    "bits": (_bad_lowbit(bits=5), r"lowbit_linear: bits=5; allowed: 2, 3, 4"),
    "k-not-whole-groups": (_bad_lowbit(x=torch.zeros(1, 80), scale=torch.ones(8, 2).half()),
                           r"group_size=32 with in_features K=80.*allowed: a positive multiple of 32 that divides K"),
    "group-size-48": (_bad_lowbit(group_size=48, x=torch.zeros(1, 96)),
                      r"group_size=48 with in_features K=96.*multiple of 32"),
    "scale-groups": (_bad_lowbit(scale=torch.ones(8, 3).half()),
                     r"scale \(8, 3\) / zero \(8, 2\); allowed: both \[N, K / group_size\] = \[N, 2\]"),
    "short-codes": (_bad_lowbit(codes=torch.zeros(100, dtype=torch.uint8)),
                    r"codes \(100,\) \(100 bytes\); allowed: .*256 bytes"),
    "x-int": (_bad_lowbit(x=torch.zeros(1, 64, dtype=torch.int32)),
              r"x dtype torch.int32; allowed: float32, float16, bfloat16"),
    "bias-size": (_bad_lowbit(bias=torch.zeros(7)), r"bias torch.float32 with 7 values; allowed: None or .* N = 8"),
    "int8-w-dtype": (lambda: lt.int8_linear(torch.zeros(1, 64), _W.float(), _S),
                     r"int8_linear: w dtype torch.float32; allowed: torch.int8"),
    "int8-k": (lambda: lt.int8_linear(torch.zeros(1, 60), _W, _S), r"w \(8, 64\) for x with K=60"),
    "int8-scale-size": (lambda: lt.int8_linear(torch.zeros(1, 64), _W, _S[:4]),
                        r"scale \(4,\); allowed: fp16 with one value per row of w \(N = 8\)"),
    "w8a8-sx-dtype": (lambda: lt.w8a8_linear(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2).half(), _W, _S),
                      r"w8a8_linear: sx dtype torch.float16; allowed: torch.float32"),
    "w8a8-sx-size": (lambda: lt.w8a8_linear(torch.zeros(2, 64, dtype=torch.int8), torch.ones(3), _W, _S),
                     r"sx \(3,\); allowed: float32 with one value per row of xq \(M = 2\)"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_are_refused_by_name(name):
    call, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        call()


def test_cpu_tensors_without_the_interpreter_are_refused():
    if lt.interpreting():
        pytest.skip("this process runs under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors \(x is on cpu\).*TRITON_INTERPRET=1"):
        lt.lowbit_linear(**_good_lowbit())


def test_supported_shapes():
    assert lt.lowbit_supported(256, 128) and lt.lowbit_supported(192, 96)
    assert not lt.lowbit_supported(160, 64) and not lt.lowbit_supported(96, 48)
    assert not lt.lowbit_supported(64, 0)
