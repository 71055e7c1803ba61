"""Bad input raises ValueError naming the value and what is allowed."""

from __future__ import annotations

import pytest
import torch

from lessmem.formats import PerChannel, PerGroup, PerTensor, SuperBlock, quantize, quantize_int
from lessmem.formats.granularity import Granularity
from lessmem.formats.packing import pack_bits, unpack_bits

X = torch.randn(4, 64)


@pytest.mark.parametrize("bits", [1, 7, 9, 0, 2.0, True])
def test_unsupported_int_bits(bits):
    with pytest.raises(ValueError, match=rf"bits={bits!r} is not supported; allowed: 2, 3, 4, 5, 6, 8"):
        quantize_int(X, bits)


@pytest.mark.parametrize("name", ["int1", "int9", "uint9", "int16", "fp4", "nf4", "fp8-e3m4", "lm9", ""])
def test_unknown_format_name(name):
    with pytest.raises(ValueError, match=rf"unknown format '{name}'; allowed: int2..int8"):
        quantize(X, name)


def test_int7_is_a_name_but_not_a_width():
    with pytest.raises(ValueError, match="bits=7 is not supported"):
        quantize(X, "int7")


def test_format_must_be_a_string():
    with pytest.raises(ValueError, match="format=4 must be a string"):
        quantize(X, 4)


def test_group_size_must_divide_the_axis():
    with pytest.raises(ValueError, match="group size 48 does not divide axis -1 of length 64"):
        quantize(X, "int4", granularity=PerGroup(48))
    with pytest.raises(ValueError, match="super-block size 256 does not divide axis -1 of length 64"):
        quantize(X, "int4", granularity=SuperBlock(256, 32))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool])
@pytest.mark.parametrize("fmt", ["int4", "uint8", "fp8-e4m3", "lm3"])
def test_non_float_tensor(dtype, fmt):
    with pytest.raises(ValueError, match=rf"x has dtype {dtype}; quantization needs a floating tensor"):
        quantize(torch.ones(4, 64, dtype=dtype), fmt)


@pytest.mark.parametrize("fmt", ["int4", "fp8-e5m2", "lm4"])
@pytest.mark.parametrize(("bad", "what"), [(float("nan"), r"1 NaN, 0 inf"), (float("inf"), r"0 NaN, 1 inf"),
                                           (float("-inf"), r"0 NaN, 1 inf")])
def test_non_finite_values(fmt, bad, what):
    x = X.clone()
    x[1, 3] = bad
    with pytest.raises(ValueError, match=rf"non-finite values \({what}\)"):
        quantize(x, fmt)


def test_not_a_tensor_and_empty():
    with pytest.raises(ValueError, match="x must be a torch.Tensor, got list"):
        quantize([1.0, 2.0], "int8")
    with pytest.raises(ValueError, match=r"x is empty \(shape \(0, 4\)\)"):
        quantize(torch.zeros(0, 4), "int8")


@pytest.mark.parametrize("clip", [0.0, -0.5, 1.5, "0.9", None])
@pytest.mark.parametrize("fmt", ["int4", "fp8-e4m3"])
def test_bad_clip_ratio(clip, fmt):
    with pytest.raises(ValueError, match=rf"clip_ratio={clip!r} must be a number in \(0, 1\]"):
        quantize(X, fmt, clip_ratio=clip)


@pytest.mark.parametrize("sd", ["fp64", "int8", torch.float64, torch.int32])
@pytest.mark.parametrize("fmt", ["int4", "fp8-e4m3", "lm4"])
def test_bad_scale_dtype(sd, fmt):
    with pytest.raises(ValueError, match=rf"scale_dtype={sd!r}; allowed:"):
        quantize(X, fmt, scale_dtype=sd)


def test_bad_granularities():
    with pytest.raises(ValueError, match="granularity='per-group' must be a Granularity object"):
        quantize(X, "int4", granularity="per-group")
    with pytest.raises(ValueError, match="group size=0 must be a positive integer"):
        PerGroup(0)
    with pytest.raises(ValueError, match="SuperBlock sub=48 must divide size=256"):
        SuperBlock(256, 48)
    with pytest.raises(ValueError, match="SuperBlock sub_scale_bits=5; allowed: 4, 6, 8"):
        SuperBlock(256, 32, sub_scale_bits=5)
    with pytest.raises(ValueError, match="PerChannel axis='0' must be an int"):
        PerChannel("0")
    with pytest.raises(ValueError, match="axis=2 is out of range for a tensor with 2 dimensions"):
        quantize(X, "int4", granularity=PerChannel(2))
    with pytest.raises(ValueError, match="granularity kind='PerRow'; allowed: PerTensor"):
        Granularity.from_dict({"kind": "PerRow"})


@pytest.mark.parametrize("g", [PerTensor(), PerChannel((0, 1)), PerGroup(16, axis=0), SuperBlock(64, 16)])
def test_granularity_dict_roundtrip(g):
    assert Granularity.from_dict(g.to_dict()) == g


def test_packing_errors():
    with pytest.raises(ValueError, match="bits=9 is not supported; allowed: 1, 2, 3, 4, 5, 6, 7, 8"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bits=0 is not supported"):
        unpack_bits(torch.zeros(8, dtype=torch.uint8), 0, 8)
    with pytest.raises(ValueError, match="packed buffer has 2 bytes but 8 codes of 3 bits need 3"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 3, 8)


def test_unknown_format_lists_every_family():
    with pytest.raises(ValueError, match="unknown format 'fp9'") as e:
        quantize(X, "fp9")
    msg = str(e.value)
    for part in ("int2..int8", "uint2..uint8", "fp8-e4m3 (=fp8-e4m3fn)", "fp8-e4m3fnuz", "fp8-e5m2",
                 "lm1..lm6"):
        assert part in msg
