"""Bit packing: layout, sizes, and the reference twin."""

from __future__ import annotations

import pytest
import torch

from lessmem.formats import PerGroup, quantize
from lessmem.formats._reference import pack_bits_reference
from lessmem.formats.packing import pack_bits, packed_nbytes, unpack_bits


def test_three_bit_packs_eight_codes_in_three_bytes():
    c = torch.tensor([1, 7, 3, 0, 5, 2, 6, 4], dtype=torch.uint8)
    p = pack_bits(c, 3)
    assert p.numel() == 3
    # stream: code i at bits [3i, 3i+3), little-endian
    assert p.tolist() == pack_bits_reference(c.tolist(), 3) == [0xF9, 0x50, 0x99]


def test_four_bit_low_nibble_first():
    assert pack_bits(torch.tensor([0x3, 0xA], dtype=torch.uint8), 4).tolist() == [0xA3]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_pack_matches_reference_and_sizes(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    c = torch.randint(0, 2**bits, (n,), generator=g).to(torch.uint8)
    p = pack_bits(c, bits)
    assert p.numel() == packed_nbytes(n, bits) == -(-n * bits // 8)
    assert p.tolist() == pack_bits_reference(c.tolist(), bits)
    assert torch.equal(unpack_bits(p, bits, n), c)


@pytest.mark.parametrize(("fmt", "bits"), [("int2", 2), ("int3", 3), ("int4", 4), ("int5", 5), ("int6", 6)])
def test_qtensor_codes_are_packed(fmt, bits):
    x = torch.randn(16, 256)
    qt = quantize(x, fmt, granularity=PerGroup(32))
    assert qt.codes.dtype == torch.uint8
    assert qt.codes.numel() == x.numel() * bits // 8
