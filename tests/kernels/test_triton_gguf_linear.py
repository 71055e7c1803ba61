"""The Triton GGUF dequant-matmul (kernels/gguf_linear_triton.py) against the test oracle
``gguf_linear_reference`` (numpy decoders, float64 matmul) and the torch decoders of
``gguf_linear_torch``, run on CPU tensors under Triton's interpreter.

The interpreter runs in one child process for the whole module (``_triton_interpret``:
triton fixes its mode at import, so this process stays normal). Tolerances: ``gguf_linear``
sums in float32 in another order than the reference, |y − ref| ≤ 1e-5·max|ref| + 1e-6
(ref + bias, in float32); ``gguf_dequantize`` equals ``gguf_dequantize_torch`` bit for bit
(signs of zero too), on quantized rows and on random bytes in every field. Argument errors
are raised before anything is launched, so they are checked in this process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]'); "
                                     "the Triton kernels are tested under its interpreter")

from _cases import gguf_rows, random_gguf_blocks  # noqa: E402
from _triton_interpret import run_interpreted  # noqa: E402

from lessmem.formats.gguf import gguf_type  # noqa: E402
from lessmem.kernels import gguf_linear_triton as kt  # noqa: E402
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref  # noqa: E402
from lessmem.kernels.gguf_linear_torch import gguf_dequantize_torch  # noqa: E402

MOD = "lessmem.kernels.gguf_linear_triton"
N = 21  # not a multiple of any BLOCK_N (powers of 2)
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def _ks(t):
    return (96, 256, 512) if t in LEGACY else (256, 512)  # 3 blocks; 1 and 2 steps of 256


def _linear_case(t, m, k, bias, seed, dtype=torch.float32, lead=None):
    g = torch.Generator().manual_seed(seed)
    raw = gguf_rows(t, N, k, seed)
    x = torch.randn(*(lead or (m,)), k, generator=g).to(dtype)
    b = torch.randn(N, generator=g) if bias else None
    return x, raw, t, N, b


LINEAR = {}
for _i, _t in enumerate(kt.SUPPORTED):
    for _m in (1, 5):
        for _j, _k in enumerate(_ks(_t)):
            _b = (_m + _j) % 2 == 1  # each (type, K) once with a bias and once without (suite time)
            LINEAR[f"{_t}-m{_m}-k{_k}-{'bias' if _b else 'nobias'}"] = _linear_case(
                _t, _m, _k, _b, seed=1000 * _i + 10 * _m + _k + _b)
LINEAR["q4_k-fp16"] = _linear_case("q4_k", 5, 512, True, 1, torch.float16)
LINEAR["q4_0-bf16"] = _linear_case("q4_0", 5, 256, False, 2, torch.bfloat16)
LINEAR["q6_k-bf16-bias"] = _linear_case("q6_k", 1, 256, True, 3, torch.bfloat16)
LINEAR["q8_0-m20"] = _linear_case("q8_0", 20, 256, True, 4)  # BLOCK_M 16: two M tiles
LINEAR["q3_k-m16"] = _linear_case("q3_k", 16, 256, False, 5)
LINEAR["q5_k-m3"] = _linear_case("q5_k", 3, 256, True, 6)  # BLOCK_M 4: x widened after its load
LINEAR["q6_k-m2"] = _linear_case("q6_k", 2, 512, True, 16)
LINEAR["q4_0-m2"] = _linear_case("q4_0", 2, 96, False, 17)
LINEAR["q4_k-lead"] = _linear_case("q4_k", 0, 256, True, 7, lead=(2, 3))
# K split over programs (CUDA picks it to fill the SMs; forced here): 2 and 3 splits of 4 steps
SPLIT = {f"{t}-split{s}": (_linear_case(t, 5, 1024, True, 8 + s), s)
         for t in ("q4_k", "q4_1", "q2_k") for s in (2, 3)}


def _strided_rows(t, k):
    """Rows 1.. of a bigger buffer, each followed by 16 other bytes: read in place."""
    raw = gguf_rows(t, N, k, 9)
    big = torch.zeros(N + 1, raw.shape[1] + 16, dtype=torch.uint8)
    big[1:, :raw.shape[1]] = raw
    return big[1:, :raw.shape[1]], raw


DEQUANT = {}
for _t in kt.SUPPORTED:
    for _k in _ks(_t)[-2:]:
        DEQUANT[f"{_t}-k{_k}-quantized"] = (gguf_rows(_t, N, _k, 11), _t, N, _k)
        DEQUANT[f"{_t}-k{_k}-random"] = (random_gguf_blocks(_t, N, _k, 12), _t, N, _k)
DEQUANT["q4_0-k96-random"] = (random_gguf_blocks("q4_0", N, 96, 13), "q4_0", N, 96)
DEQUANT["q5_1-k96-random"] = (random_gguf_blocks("q5_1", N, 96, 14), "q5_1", N, 96)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    calls = {f"linear/{name}": (f"{MOD}:gguf_linear", args, {}) for name, args in LINEAR.items()}
    calls.update({f"split/{name}": (f"{MOD}:_gguf_linear", args, {"split": s})
                  for name, (args, s) in SPLIT.items()})
    calls.update({f"dequant/{name}": (f"{MOD}:gguf_dequantize", args, {})
                  for name, args in DEQUANT.items()})
    view, _ = _strided_rows("q4_k", 512)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(15))
    calls["strided/linear"] = (f"{MOD}:gguf_linear", (x, view, "q4_k", N), {})
    calls["strided/dequant"] = (f"{MOD}:gguf_dequantize", (view, "q4_k", N, 512), {})
    calls["empty"] = (f"{MOD}:gguf_linear", (torch.randn(0, 256), gguf_rows("q4_0", N, 256, 1), "q4_0", N), {})
    return run_interpreted(calls, tmp_path_factory.mktemp("triton_gguf"))


def _check_linear(res, x, raw, t, n, bias):
    assert res[0] == "ok", res
    y = res[1]
    ref = gguf_linear_ref(x.float(), raw, t, n)
    if bias is not None:
        ref = ref + bias
    assert y.dtype == torch.float32 and y.shape == ref.shape == (*x.shape[:-1], n)
    tol = 1e-5 * float(ref.abs().max()) + 1e-6
    err = float((y - ref).abs().max())
    assert err <= tol, f"max |y - ref| = {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("name", list(LINEAR))
def test_linear_matches_reference(results, name):
    _check_linear(results[f"linear/{name}"], *LINEAR[name])


@pytest.mark.parametrize("name", list(SPLIT))
def test_split_k_matches_reference(results, name):
    _check_linear(results[f"split/{name}"], *SPLIT[name][0])


@pytest.mark.parametrize("name", list(DEQUANT))
def test_dequantize_bit_identical_to_torch_decoder(results, name):
    res = results[f"dequant/{name}"]
    assert res[0] == "ok", res
    raw, t, n, k = DEQUANT[name]
    ref = gguf_dequantize_torch(raw, t, n)
    assert res[1].shape == (n, k) and res[1].dtype == torch.float32
    assert res[1].numpy().tobytes() == ref.numpy().tobytes()  # every bit, signs of zero too


def test_strided_rows_are_read_in_place(results):
    view, raw = _strided_rows("q4_k", 512)
    assert not view.is_contiguous()
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(15))
    _check_linear(results["strided/linear"], x, raw, "q4_k", N, None)
    assert results["strided/dequant"][0] == "ok", results["strided/dequant"]
    assert torch.equal(results["strided/dequant"][1], gguf_dequantize_torch(raw, "q4_k", N))


def test_no_rows_no_launch(results):
    status, y = results["empty"]
    assert status == "ok" and y.shape == (0, N) and y.dtype == torch.float32


def test_supported_types():
    assert set(kt.SUPPORTED) >= {"q4_0", "q8_0", "q4_k", "q6_k"}
    assert all(t in kt.TILES for t in kt.SUPPORTED)


def test_unsupported_type_raises_not_implemented():
    later = dataclasses.replace(gguf_type("q4_0"), name="iq4_nl", ggml_id=20)  # a type added later
    x, raw = torch.randn(1, 32), torch.zeros(N, 18, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match=r"IQ4_NL; supported: q4_0, q8_0, q4_k, q6_k"):
        kt.gguf_linear(x, raw, later, N)
    with pytest.raises(NotImplementedError, match="IQ4_NL"):
        kt.gguf_dequantize(raw, later, N, 32)
    with pytest.raises(ValueError, match="not supported; allowed"):  # a name no module knows
        kt.gguf_linear(x, raw, "q7_x", N)


def _bad(**kw):
    args = dict(x=torch.randn(2, 256), raw=gguf_rows("q4_k", 4, 256, 0), qtype="q4_k", out_features=4,
                bias=None)
    args.update(kw)
    return args


@pytest.mark.parametrize("kw, match", [
    (dict(raw=torch.zeros(4, 144, dtype=torch.int8)), r"dtype torch.int8; allowed: a uint8"),
    (dict(raw=torch.zeros(4, 143, dtype=torch.uint8)), r"raw holds 572 bytes; \[4, 256\] in Q4_K needs 576"),
    (dict(x=torch.randn(2, 200)), r"in_features=200; allowed: a positive multiple of the Q4_K block size 256"),
    (dict(out_features=0), r"out_features=0; allowed: a positive integer"),
    (dict(bias=torch.randn(5)), r"bias of 5 values.*allowed: 4 floats"),
    (dict(x=torch.randn(2, 256).double()), r"x of dtype torch.float64.*allowed: float32, float16 or bfloat16"),
    (dict(raw=gguf_rows("q4_k", 4, 256, 0).T), r"strides \(1, 144\); allowed: contiguous, or \[4, 144\] rows"),
])
def test_bad_arguments_raise_value_error_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        kt.gguf_linear(**_bad(**kw))


def test_dequantize_bad_shape():
    with pytest.raises(ValueError, match=r"in_features=100; allowed: a positive multiple of the Q4_0 block size 32"):
        kt.gguf_dequantize(torch.zeros(4, 72, dtype=torch.uint8), "q4_0", 4, 100)


def test_cpu_tensors_without_the_interpreter_are_refused():
    if kt.interpreting():
        pytest.skip("this process runs under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match=r"runs on GPU tensors \(these are on cpu\).*TRITON_INTERPRET=1"):
        kt.gguf_linear(**_bad())
    with pytest.raises(ValueError, match="tensors on meta and cpu"):
        kt.gguf_linear(**_bad(bias=torch.randn(4, device="meta")))
