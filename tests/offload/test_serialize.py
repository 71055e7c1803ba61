import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lessmem.formats import PerGroup, PerToken, quantize
from lessmem.offload.serialize import (
    HEADER_BYTES,
    CorruptBlockError,
    block_nbytes,
    pack_block,
    unpack_block,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.float64, torch.bool, torch.float8_e4m3fn]


@settings(max_examples=40, deadline=None)
@given(dt=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       seed=st.integers(0, 2**16))
def test_roundtrip_bit_exact(dt, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    size = torch.empty(0, dtype=dt).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    t = raw.view(dt).reshape(shape) if dt != torch.bool else (raw > 127).reshape(shape)
    block, meta = unpack_block(pack_block({"t": t, "z": torch.zeros(3)}, meta={"i": seed}))
    assert block["t"].dtype == dt and block["t"].shape == t.shape
    # compare raw bytes: NaN payloads must survive too
    assert torch.equal(block["t"].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert meta == {"i": seed} and list(block) == ["t", "z"]


@pytest.mark.parametrize("fmt,gran", [("uint4", PerGroup(32)), ("int8", PerToken()),
                                      ("uint2", PerGroup(16, axis=-2))])
def test_qtensor_roundtrip(fmt, gran):
    x = torch.randn(1, 3, 32, 64)
    q = quantize(x, fmt, granularity=gran)
    b, _ = unpack_block(pack_block({"k": q, "w": x}))
    r = b["k"]
    assert r.fmt == q.fmt and r.shape == q.shape and r.dtype == q.dtype and r.meta == q.meta
    assert torch.equal(r.codes, q.codes) and torch.equal(r.scale, q.scale)
    assert torch.equal(r.dequantize(), q.dequantize()) and torch.equal(b["w"], x)
    assert block_nbytes(b) == block_nbytes({"k": q, "w": x})


def test_every_flipped_byte_is_detected():
    blob = bytearray(pack_block({"a": torch.arange(10, dtype=torch.int16)}, meta={"key": "x"}))
    for i in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(CorruptBlockError):
            unpack_block(bad)


def test_truncated_and_extended_detected():
    blob = pack_block({"a": torch.ones(100)})
    for n in (0, 10, HEADER_BYTES, len(blob) - 1):
        with pytest.raises(CorruptBlockError, match="truncated|length"):
            unpack_block(blob[:n])
    with pytest.raises(CorruptBlockError, match="length"):
        unpack_block(blob + b"\0")
    with pytest.raises(CorruptBlockError, match="magic"):
        unpack_block(b"X" * len(blob))


def test_bad_entries_rejected():
    with pytest.raises(ValueError, match="allowed: torch.Tensor, QTensor"):
        pack_block({"a": [1, 2]})
    with pytest.raises(ValueError, match="without '#'"):
        pack_block({"a#b": torch.ones(1)})
    with pytest.raises(ValueError, match="cannot be serialized"):
        pack_block({"a": torch.ones(1, dtype=torch.complex64)})
