"""KVLayout: the one description of a quantized KV side's bytes (packing, parts, shapes)."""

from __future__ import annotations

import pytest
import torch

from lessmem.formats.kvlayout import KVLayout
from lessmem.formats.packing import pack_bits
from lessmem.kernels.attention_reference import unpack_codes

LAYOUTS = [(1, "split"), (2, "split"), (4, "split"), (8, "split"), (1, "stream"), (2, "stream"),
           (3, "stream"), (4, "stream"), (5, "stream"), (6, "stream"), (7, "stream"), (8, "stream")]


@pytest.mark.parametrize("bits,packing", LAYOUTS)
def test_pack_unpack_round_trip_and_oracle_agree(bits, packing):
    lay = KVLayout(bits, 64, 16, packing=packing)
    u = torch.randint(0, 2**bits, (2, 3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    codes = lay.pack(u)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 5, lay.row_bytes) and lay.row_bytes == 8 * bits
    assert torch.equal(lay.unpack(codes), u.long())
    assert torch.equal(unpack_codes(codes, lay), u.long())  # the test oracle reads the same bytes
    if packing == "stream":  # each row is the dense little-endian bit stream of its codes
        assert torch.equal(codes[1, 2, 3], pack_bits(u[1, 2, 3], bits))


def test_split_rows_hold_channels_a_quarter_apart():
    lay = KVLayout(bits=2, head_dim=8, channel_group=8)
    u = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=torch.uint8)
    # byte j: channel j (bits 0-1), j + 2 (bits 2-3), j + 4 (bits 4-5), j + 6 (bits 6-7)
    assert lay.pack(u).tolist() == [0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6]


def test_defaults_parts_and_shapes():
    assert KVLayout(4, 64, 64).packing == "split" and KVLayout(3, 64, 64).packing == "stream"
    lay = KVLayout(4, 64, channel_group=1, token_group=32, has_zero_point=True)
    assert lay.parts == ("codes", "scale", "zero_point")
    assert KVLayout(4, 64, 64).parts == ("codes", "scale")
    assert [lay.tokens_per_row(p) for p in lay.parts] == [1, 32, 32]
    assert lay.part_shape("codes", 2, 3, 96) == (2, 3, 96, 32)
    assert lay.part_shape("scale", 2, 3, 96) == (2, 3, 3, 64)
    assert lay.part_shape("zero_point", 2, 3, 80) == (2, 3, 3, 64)  # a partial group counts
    assert lay == KVLayout(4, 64, channel_group=1, token_group=32, has_zero_point=True)  # cache not compared
    assert lay.lut() is None and KVLayout(1, 8, 8, levels=(-1.0, 1.0)).lut().tolist() == [-1.0, 1.0]


def test_dequantize_applies_scale_zero_and_levels():
    lay = KVLayout(bits=2, head_dim=4, channel_group=2, token_group=2, has_zero_point=True,
                   levels=(0.0, 1.0, 4.0, 9.0))
    codes = lay.pack(torch.tensor([[[[0, 1, 2, 3], [3, 3, 0, 0]]]], dtype=torch.uint8))
    scale = torch.tensor([[[[0.5, 2.0]]]]).half()
    zp = torch.tensor([[[[1, 0]]]], dtype=torch.uint8)
    out = lay.dequantize(codes, scale, zp)
    assert out.tolist() == [[[[-0.5, 0.0, 8.0, 18.0], [4.0, 4.0, 0.0, 0.0]]]]
    with pytest.raises(ValueError, match="zero_point missing"):
        lay.dequantize(codes, scale)


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=9, head_dim=64, channel_group=64), "bits=9; allowed: 1 to 8"),
    (dict(bits=4, head_dim=0, channel_group=1), "head_dim=0; allowed: an integer >= 1"),
    (dict(bits=4, head_dim=64, channel_group=48), "channel_group=48 does not divide head_dim=64"),
    (dict(bits=3, head_dim=12, channel_group=12), "head_dim=12 at 3 bits is not a whole number of bytes"),
    (dict(bits=3, head_dim=64, channel_group=64, packing="split"), "packing 'split' needs bits dividing 8"),
    (dict(bits=4, head_dim=64, channel_group=64, packing="nibbles"), "packing='nibbles'; allowed: split, stream"),
    (dict(bits=2, head_dim=64, channel_group=64, levels=(0.0, 1.0)), "levels has 2 entries; allowed: 2\\*\\*bits = 4"),
    (dict(bits=4, head_dim=64, channel_group=64, token_group=0), "token_group=0; allowed"),
])
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVLayout(**kwargs)


def test_bad_part_or_row_width_is_refused():
    lay = KVLayout(4, 64, 64)
    with pytest.raises(ValueError, match="part='codez'; allowed: codes, scale, zero_point"):
        lay.tokens_per_row("codez")
    with pytest.raises(ValueError, match="code rows of 31 bytes; allowed: row_bytes=32"):
        lay.unpack(torch.zeros(1, 1, 1, 31, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes have 63 channels; allowed: head_dim=64"):
        lay.pack(torch.zeros(1, 1, 1, 63, dtype=torch.uint8))
