"""The affine KV quantizer's C++ loop (``kernels/csrc/kv_encode.cpp``) against its torch twin
(``formats.integer.choose_qparams`` + ``quantize_grouped``): codes, fp16 scales and zero
points equal bit for bit, for every bit width, both formats, clipping, and the rows that
exercise the edges (all zero, constant, one sign, tiny and huge ranges, exact ties)."""

from __future__ import annotations

import pytest
import torch

from lessmem.kvcache import codec
from lessmem.kvcache.config import KVTensorConfig
from lessmem.kvcache.encode_op import encode_chunk
from lessmem.kvcache.presets import resolve

pytestmark = pytest.mark.skipif(codec._affine_cpp() is None, reason="no C++ compiler")


def _rows(E: int, g: torch.Generator) -> torch.Tensor:
    base = torch.randn(64, E, generator=g) * torch.logspace(-6, 6, 64).unsqueeze(1)
    edge = torch.stack([
        torch.zeros(E), torch.full((E,), 3.0), torch.full((E,), -2.5),
        torch.rand(E, generator=g) + 0.5, -(torch.rand(E, generator=g) + 0.5),  # one sign only
        torch.randn(E, generator=g) * 1e-9, torch.randn(E, generator=g) * 1e9,  # below the fp16 floor, above its max
        torch.arange(E).float() - E / 2, (torch.arange(E).float() - E / 2) * 0.5,  # exact ties on the grid
        torch.where(torch.arange(E) % 2 == 0, 0.0, -0.0),
    ])
    return torch.cat([base, edge])


@pytest.fixture
def torch_twin(monkeypatch):
    """A context in which the codec takes its torch path (no C++ module)."""
    import contextlib

    @contextlib.contextmanager
    def twin():
        with monkeypatch.context() as m:
            m.setattr(codec, "_affine_cpp", lambda: None)
            yield
    return twin


def _both(xg, spec, lay, twin):
    with twin():
        ref = codec._affine(xg, spec, lay)
    return codec._affine(xg, spec, lay), ref


@pytest.mark.parametrize("fmt", ["uint", "int"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("clip", [1.0, 0.9])
def test_affine_codes_equal_the_torch_twin_bit_for_bit(fmt, bits, clip, torch_twin):
    g = torch.Generator().manual_seed(bits * 10 + (fmt == "int"))
    for E in (64, 32, 7):
        spec = KVTensorConfig(fmt, bits, clip_ratio=clip)
        lay = codec.kv_layout(spec, 64)
        xg = _rows(E, g)
        (u, s, z), (u0, s0, z0) = _both(xg, spec, lay, torch_twin)
        assert u.dtype == u0.dtype == torch.uint8 and torch.equal(u, u0)
        assert s.dtype == s0.dtype == torch.float16 and torch.equal(s.view(torch.int16), s0.view(torch.int16))
        assert (z is None) == (z0 is None) == (fmt == "int")
        if z is not None:
            assert z.dtype == z0.dtype and torch.equal(z, z0)


@pytest.mark.parametrize("preset", ["best-4", "int4", "int8", "kivi-2"])
def test_encoded_chunks_equal_the_torch_twin(preset, torch_twin):
    """Whole chunks through ``encode_chunk`` (the cache's path), keys and values."""
    cfg = resolve(preset)
    x = torch.randn(2, 3, 128, 64, generator=torch.Generator().manual_seed(1)) * 3
    for spec in (cfg.keys, cfg.values):
        got = encode_chunk(x, spec)
        with torch_twin():
            ref = encode_chunk(x, spec)
        for a, b in ((got.codes, ref.codes), (got.scale, ref.scale), (got.zero_point, ref.zero_point)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
