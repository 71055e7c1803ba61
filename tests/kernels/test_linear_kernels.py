"""Fused linear kernels against their dequantize-then-matmul twins."""

import pytest
import torch

from lessmem.formats.packing import pack_bits
from lessmem.kernels import int4_linear as i4
from lessmem.kernels import linear_cpp
from lessmem.kernels import linear_reference as ref


@pytest.fixture(params=["cpp", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(linear_cpp, "_mod", lambda: None)
    elif not linear_cpp.available():
        pytest.skip("no C++ compiler: only the torch twin runs")
    return request.param


@pytest.mark.parametrize("m", [1, 3, 20])
def test_int8_matches_reference(backend, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=g)
    s = torch.rand(48, generator=g) / 50
    x = torch.randn(m, 96, generator=g)
    torch.testing.assert_close(linear_cpp.int8_linear(x, w, s), ref.int8_linear_ref(x, w, s),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 5])
def test_w8a8_integer_sums_exact(backend, m):
    g = torch.Generator().manual_seed(1)
    xq = torch.randint(-127, 128, (m, 64), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    sx, sw = torch.ones(m), torch.ones(32)
    y = linear_cpp.w8a8_linear(xq, sx, w, sw)
    assert torch.equal(y, (xq.long() @ w.long().T).float())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("gs", [32, 64])
@pytest.mark.parametrize("m", [1, 4])
def test_lowbit_matches_reference(backend, bits, gs, m):
    g = torch.Generator().manual_seed(bits * 100 + gs + m)
    n, k = 40, 128
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g) / 10
    zero = torch.randint(0, 2**bits, (n, k // gs), generator=g).float()
    x = torch.randn(m, k, generator=g)
    codes = pack_bits(u, bits)
    y = linear_cpp.lowbit_linear(x, codes, bits, scale, zero, gs)
    w = ref.dequant_grouped_weight(u, scale, zero, gs)
    torch.testing.assert_close(y, (x.double() @ w.T).float(), rtol=1e-4, atol=1e-4)


def test_lowbit_bad_bits():
    with pytest.raises(ValueError, match="bits=5"):
        linear_cpp.lowbit_linear(torch.randn(1, 64), torch.zeros(40, dtype=torch.uint8), 5,
                                 torch.ones(1, 2), torch.ones(1, 2), 32)


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
