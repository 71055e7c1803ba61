"""Fused linear kernels against the test oracle ``linear_reference`` (dequantize, then matmul
in float64): each test runs the C++ kernels and, with ``_mod`` patched to None (no compiler),
the torch fallbacks of ``linear_torch`` that ``linear_cpp`` then calls."""

from pathlib import Path

import pytest
import torch
from _cases import lowbit_case as _lowbit_case

from lessmem.kernels import int4_linear as i4
from lessmem.kernels import linear_cpp
from lessmem.kernels import linear_reference as ref

ROWS = [1, 2, 3, 4, 5, 7, 8, 16]  # the fused path's batch sizes (tiles of 4 rows + remainders)


@pytest.fixture(params=["cpp", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(linear_cpp, "_mod", lambda: None)
    elif not linear_cpp.available():
        pytest.skip("no C++ compiler: only the torch fallback runs")
    return request.param


def _act16_bound(x, w, gs):
    """|x̂ W^T − x W^T| ≤ Σ_k |W[n, k]| · d[m, g(k)] / 2 (plus float32 summation slack)."""
    _, d = ref.quantize_act16(x.float(), gs)
    step = d.double().repeat_interleave(gs, dim=1) / 2
    return step @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_int8_matches_reference(backend, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=g)
    s = (torch.rand(48, generator=g) / 50).half()
    x = torch.randn(m, 96, generator=g)
    torch.testing.assert_close(linear_cpp.int8_linear(x, w, s), ref.int8_linear_ref(x, w, s),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5])
def test_w8a8_integer_sums_exact(backend, m):
    g = torch.Generator().manual_seed(1)
    xq = torch.randint(-127, 128, (m, 64), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    sx, sw = torch.ones(m), torch.ones(32, dtype=torch.float16)
    y = linear_cpp.w8a8_linear(xq, sx, w, sw)
    assert torch.equal(y, (xq.long() @ w.long().T).float())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("gs,n,k", [(32, 37, 224), (64, 19, 576), (128, 5, 384), (32, 7, 512)])
def test_lowbit_matches_reference(backend, bits, sym, gs, n, k):
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, sym, bits * 1000 + gs + n)
    w = ref.dequant_grouped_weight(u, scale, zero, gs)
    gen = torch.Generator().manual_seed(7)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs)
        # the twin rounds activations exactly as the kernel does: equal up to float32 sums
        expect = ref.lowbit_linear_ref(x, codes, bits, scale, zero, gs)
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
        # and against float activations the 16-bit rounding stays inside its bound
        exact = x.double() @ w.T
        assert ((y.double() - exact).abs() <= _act16_bound(x, w, gs)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lowbit_dtypes_and_noncontiguous(backend, dtype):
    bits, gs, n, k = 3, 64, 24, 256
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, False, 5)
    base = torch.randn(6, 2 * k).to(dtype)
    x = base[:, ::2]  # strided view: not contiguous
    assert not x.is_contiguous()
    y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs)
    assert y.dtype == torch.float32 and y.shape == (6, n)
    expect = ref.lowbit_linear_ref(x.float().contiguous(), codes, bits, scale, zero, gs)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    # leading batch dims are kept
    y3 = linear_cpp.lowbit_linear(x.reshape(2, 3, k), codes, bits, scale, zero, gs)
    torch.testing.assert_close(y3.reshape(6, n), y)


@pytest.mark.parametrize("m", [1, 6])
def test_lowbit_reads_nothing_past_its_tensors(backend, m):
    """Scales/zero points sit in a larger buffer whose tail is NaN / 255: none of it may leak
    (the kernel reads group vectors in 8-wide steps, i.e. past a row's end)."""
    bits, gs, n, k = 3, 128, 5, 384  # 3 groups per row: 8-wide reads span several rows
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, False, 21)
    sbuf = torch.full((n * 3 + 64,), float("nan"), dtype=torch.float16)
    zbuf = torch.full((n * 3 + 64,), 255, dtype=torch.uint8)
    sbuf[: n * 3] = scale.reshape(-1)
    zbuf[: n * 3] = zero.reshape(-1)
    cbuf = torch.full((codes.numel() + 64,), 255, dtype=torch.uint8)
    cbuf[: codes.numel()] = codes
    x = torch.randn(m, k)
    y = linear_cpp.lowbit_linear(x, cbuf[: codes.numel()], bits, sbuf[: n * 3].view(n, 3),
                                 zbuf[: n * 3].view(n, 3), gs)
    torch.testing.assert_close(y, ref.lowbit_linear_ref(x, codes, bits, scale, zero, gs),
                               rtol=1e-5, atol=1e-5)


def test_lowbit_bias_added_in_kernel(backend):
    bits, gs, n, k = 2, 32, 9, 64
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, False, 3)
    x, bias = torch.randn(3, k), torch.randn(n)
    y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs, bias)
    torch.testing.assert_close(y, ref.lowbit_linear_ref(x, codes, bits, scale, zero, gs) + bias,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"bias \(8,\); allowed: None or \[9\]"):
        linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs, bias[:8])


def test_lowbit_activation_outlier_stays_in_its_group():
    """One huge activation coarsens only its own group's 16-bit step."""
    bits, gs, n, k = 4, 32, 16, 128
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, False, 11)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(11))  # not the global RNG: order-free
    x[0, 5] = 1e4
    q, d = ref.quantize_act16(x, gs)
    assert d[0, 0] > 100 * d[0, 1:].max()
    xhat = q.double() * d.double().repeat_interleave(gs, dim=1)
    err = (xhat - x.double()).abs()
    assert (err <= d.double().repeat_interleave(gs, dim=1) / 2 + 1e-12).all()
    assert err[0, gs:].max() < 1e-4  # other groups: N(0, 1) activations at step ~1e-4
    w = ref.dequant_grouped_weight(u, scale, zero, gs)
    y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs)
    assert ((y.double() - x.double() @ w.T).abs() <= _act16_bound(x, w, gs)).all()


@pytest.mark.parametrize("flags,code", [(("-DLESSMEM_NO_VNNI", "-DLESSMEM_NO_VBMI"), 1),
                                        (("-DLESSMEM_NO_SIMD",), 0)])
def test_lowbit_fallback_builds_agree(monkeypatch, flags, code):
    """The AVX2-only and plain-C++ builds of the same source give the same results."""
    if not linear_cpp.available():
        pytest.skip("no C++ compiler")
    full = linear_cpp._mod()
    if code == 1 and full.simd_build() == 0:
        pytest.skip("no AVX2 on this machine")
    if code == 1 and full.simd_build() == 1:  # (a 45 s build of what every other test runs)
        pytest.skip("the default build is already the AVX2-only one (no AVX-512 VNNI/VBMI here)")
    mod = linear_cpp._mod(flags)
    if mod is None:
        pytest.skip(f"build with {flags} failed")
    assert mod.simd_build() == code
    monkeypatch.setattr(linear_cpp, "_mod", lambda: mod)
    for bits in (2, 3, 4):
        u, codes, scale, zero = _lowbit_case(bits, 13, 192, 64, bits == 3, bits)
        for m in (1, 3, 6):
            x = torch.randn(m, 192)
            y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, 64)
            torch.testing.assert_close(y, ref.lowbit_linear_ref(x, codes, bits, scale, zero, 64),
                                       rtol=1e-5, atol=1e-5)
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    s = (torch.rand(8) / 50).half()
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear_cpp.int8_linear(x, w, s), ref.int8_linear_ref(x, w, s),
                               rtol=1e-5, atol=1e-4)


def test_lowbit_bad_args():
    x = torch.randn(1, 64)
    codes = torch.zeros(64, dtype=torch.uint8)
    s, z = torch.ones(4, 2, dtype=torch.float16), torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits=5; allowed: 2, 3, 4"):
        linear_cpp.lowbit_linear(x, codes, 5, s, z, 32)
    with pytest.raises(ValueError, match="group_size=48.*multiple of 32"):
        linear_cpp.lowbit_linear(torch.randn(1, 96), codes, 4, s, z, 48)
    with pytest.raises(ValueError, match="group_size=65536.*at most 32768"):  # int32 lane sums
        linear_cpp.lowbit_linear(torch.randn(1, 65536), codes, 4, s, z, 65536)
    with pytest.raises(ValueError, match="scale dtype torch.float32; allowed: torch.float16"):
        linear_cpp.lowbit_linear(x, codes, 4, s.float(), z, 32)
    with pytest.raises(ValueError, match="zero dtype torch.float32; allowed: torch.uint8"):
        linear_cpp.lowbit_linear(x, codes, 4, s, z.float(), 32)
    with pytest.raises(ValueError, match=r"scale \(4, 1\).*\[4, 2\]"):
        linear_cpp.lowbit_linear(x, codes, 4, s[:, :1], z[:, :1], 32)
    with pytest.raises(ValueError, match="codes torch.uint8 with 10 bytes.*128 bytes"):
        linear_cpp.lowbit_linear(x, codes[:10], 4, s, z, 32)
    with pytest.raises(ValueError, match="scale dtype torch.float32"):
        linear_cpp.int8_linear(x, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4))


def test_int4pack_matches_reference():
    g = torch.Generator().manual_seed(0)
    n, k, gs = 64, 256, 64
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // gs, generator=g) / 10).half()
    zp = torch.randint(0, 16, (n, k // gs), generator=g).to(torch.uint8)
    sz = i4.scales_and_zeros(scale, zp)
    x = torch.randn(3, k, generator=g)
    y = i4.int4_linear(x, i4.pack_int4(u), gs, sz)
    expect = ref.int4pack_linear_ref(x, u, sz[..., 0].T, sz[..., 1].T, gs)
    # the op accumulates in float from bf16 inputs; compare at bf16-level tolerance
    torch.testing.assert_close(y, expect, rtol=2e-2, atol=2e-2)
    # and the zero form z = s * (8 - zp) reproduces s * (u - zp)
    w_affine = ref.dequant_grouped_weight(u, sz[..., 0].T.float(),
                                          zp.float(), gs)
    w_op = sz[..., 0].T.double().repeat_interleave(gs, 1) * (u.double() - 8) + \
        sz[..., 1].T.double().repeat_interleave(gs, 1)
    assert (w_affine - w_op).abs().max() < 2e-2 * scale.float().max()


@pytest.mark.parametrize("n,k", [(32, 64), (48, 512), (1536 // 8, 576)])
def test_int4_unpack_inverts_pack(n, k):
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    assert torch.equal(i4.unpack_int4(i4.pack_int4(u), n, k), u)


def test_cpp_sources_ship_with_the_package(monkeypatch):
    """The kernels' C++ is read from lessmem/kernels/csrc (package data), every exported
    function is defined there, and the build key follows the text of the file."""
    from lessmem.kernels import _build, gguf_linear_cpp

    for module in (linear_cpp, gguf_linear_cpp):
        src = _build.cpp_source(module._SOURCE_FILE)
        for fn in module._FUNCS:
            assert f" {fn}(" in src, (module.__name__, fn)
    src = _build.cpp_source("linear.cpp")
    key = _build.build_key(src)
    assert key == _build.build_key(src) and len(key) == 12
    assert _build.build_key(src + "\n// edited\n") != key
    assert _build.build_key(src, ["-DLESSMEM_NO_SIMD"]) != key
    cpu = _build.host_cpu()
    assert cpu and ("flags" in cpu or "Features" in cpu or not Path("/proc/cpuinfo").exists())
    # a cache dir shared with a machine whose CPU lacks an instruction must not load its build
    monkeypatch.setattr(_build, "host_cpu", lambda: cpu.replace("avx2", "").replace("avx512", "") + " other")
    assert _build.build_key(src) != key


def test_cpp_checks_build_messages_without_iostreams(monkeypatch):
    """Every C++ argument check goes through csrc/lm_check.h (LM_CHECK / LM_CHECK_VALUE), which
    load_cpp_file puts before each source: TORCH_CHECK's own formatting of numbers crashed
    the process, instead of raising, where the extension held its own libstdc++ streams."""
    import os
    import re

    from lessmem.kernels import _build

    for name in ("linear.cpp", "gguf_linear.cpp", "attention.cpp"):
        src = _build.cpp_source(name)
        assert not re.search(r"TORCH_CHECK|TORCH_INTERNAL_ASSERT|c10::str\(|std::ostream|stringstream", src), name
        assert "LM_CHECK" in src, name
    seen = {}
    monkeypatch.setattr(_build, "load_cpp", lambda name, source, *a, **k: seen.setdefault(name, source))
    monkeypatch.setattr(_build, "_FILES", {})  # load_cpp_file's memo of earlier answers
    _build.load_cpp_file("lessmem_linear", "linear.cpp", ["f"])
    head = _build.cpp_source(_build.CHECK_HEADER)
    assert seen["lessmem_linear"] == head + '\n#line 1 "linear.cpp"\n' + _build.cpp_source("linear.cpp")
    monkeypatch.undo()
    if os.environ.get("LESSMEM_BUILD_TESTS") != "1":
        return  # the build below takes ~45 s on two cores: opt-in
    # the failure mode itself: libstdc++ linked into the extension (-static-libstdc++)
    src = head + r"""
void lm_fail(int64_t n) { LM_CHECK_VALUE(n == 0, "lm: n=", n, ", shape ", c10::IntArrayRef({2, 3})); }
"""  # (TORCH_CHECK_VALUE with the same parts raises "torch: n=" here, the number dropped)
    m = _build.load_cpp("lessmem_check_static", src, ["lm_fail"],
                        extra_ldflags=["-static-libstdc++"])
    if m is None:
        pytest.skip("no static libstdc++ to link")
    with pytest.raises(ValueError, match=r"^lm: n=7, shape \[2, 3\]$"):
        m.lm_fail(7)


def test_missing_cpp_source_falls_back_with_a_warning():
    from lessmem.kernels import _build

    with pytest.raises(FileNotFoundError, match="'nope.cpp' not found in lessmem.kernels/csrc"):
        _build.cpp_source("nope.cpp")
    with pytest.warns(RuntimeWarning, match="could not build the C\\+\\+ kernel 'lessmem_nope'"):
        assert _build.load_cpp_file("lessmem_nope", "nope.cpp", ["f"]) is None
