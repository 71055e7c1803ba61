"""Encode one chunk of keys or values ``[B, H, T, D]`` into the cache's stored layout.

Each KV format is one entry of :data:`FORMATS`: its bit widths, its
:class:`~lessmem.formats.kvlayout.KVLayout` fields (zero point or constant zero, level
table) and its quantizer (how a group of values becomes a scale, codes and maybe a zero
point). ``kv_layout(spec, head_dim)`` builds the layout every reader uses (the attention
kernels, their torch fallback, the test oracle); ``encode`` quantizes and packs with it.
Adding a format means one entry here (its name and bits are also checked by
``config.KVTensorConfig``; a test keeps the two equal) and, only where its layout needs
a new packing, kernel code.

Every format dequantizes as ``x = scale · (lut[c] − z)`` (z = zero point, or a constant):
int (symmetric): z = 2^(b−1), no table; uint: a uint8 zero point per group; fp8: the
table holds the fp8 value of each byte; lm: the table holds the Lloyd-Max levels of a
unit Gaussian (``formats.codebook.gaussian_codebook``) and the scale is the group's RMS.

Example:
    >>> import torch
    >>> from lessmem.formats import PerGroup
    >>> from lessmem.kvcache.config import KVTensorConfig
    >>> spec = KVTensorConfig("uint", 4, PerGroup(8, axis=-2))
    >>> x = torch.randn(1, 2, 16, 64)
    >>> enc = encode(x, spec)
    >>> tuple(enc.codes.shape), tuple(enc.scale.shape)
    ((1, 2, 16, 32), (1, 2, 2, 64))
    >>> lay = kv_layout(spec, 64)
    >>> bool((lay.dequantize(enc.codes, enc.scale, enc.zero_point) - x).abs().max() < 0.5)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..formats.codebook import assign, gaussian_codebook
from ..formats.integer import choose_qparams, quantize_grouped
from ..formats.kvlayout import KVLayout
from .config import KVTensorConfig

_FP8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Encoded:
    """Codes, scale and (optional) zero point of a chunk, in the stored layout."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored parts by name (``KVLayout.parts``): zero point only when present."""
        out = {"codes": self.codes, "scale": self.scale}
        if self.zero_point is not None:
            out["zero_point"] = self.zero_point
        return out


# ---- per-format quantizers: grouped view [G, E] -> (codes uint8 [G, E], scale [G], zp or None)
def _affine(xg, spec: KVTensorConfig, lay: KVLayout):
    m = _affine_cpp() if xg.device.type == "cpu" else None
    if m is not None:  # the same float32 operations, row by row in one C++ loop (bit for bit: tested)
        u, scale, zp = m.affine_codes(xg.float().contiguous(), int(spec.bits), not lay.has_zero_point,
                                      float(spec.clip_ratio))
        return u, scale, (zp if lay.has_zero_point else None)
    scale, zp = choose_qparams(xg, spec.bits, not lay.has_zero_point, spec.clip_ratio, lay.SCALE_DTYPE)
    return quantize_grouped(xg, scale, zp, spec.bits), scale, zp


def _affine_cpp():
    """``kernels/csrc/kv_encode.cpp``'s module: ``affine_codes`` (its scales float16, as
    ``KVLayout.SCALE_DTYPE``) and ``write_rows`` (``layer.append_rows``), or None without a
    compiler: the torch twins then run."""
    from ..kernels._build import load_cpp_file

    return load_cpp_file("lessmem_kv_encode", "kv_encode.cpp", ["affine_codes", "write_rows"],
                         ["-ffp-contract=off"])


def _affine_channels(xg, spec: KVTensorConfig, lay: KVLayout):
    """Per-channel groups at each channel's own bits (``spec.channel_bits``; row r of the
    grouped view is channel r mod D), the affine quantizer with per-row bits. A 0-bit channel
    stores its group's mean as ``−scale · z`` with z = 1 and no code (its code is 0)."""
    bits = torch.tensor(spec.channel_bits, device=xg.device).repeat(xg.shape[0] // len(spec.channel_bits))
    nonzero = bits.clamp(min=1)
    scale, zp = choose_qparams(xg, nonzero, False, spec.clip_ratio, lay.SCALE_DTYPE)
    u = quantize_grouped(xg, scale, zp, nonzero)
    zero = bits == 0
    scale = torch.where(zero, (-xg.float().mean(dim=1)).to(lay.SCALE_DTYPE), scale)
    zp = torch.where(zero, torch.ones_like(zp), zp)
    u = torch.where(zero.unsqueeze(1), torch.zeros_like(u), u)
    return u, scale, zp


def _fp8(xg, spec: KVTensorConfig, lay: KVLayout):
    dtype = _FP8[spec.format]
    fmax = torch.finfo(dtype).max
    amax = xg.abs().amax(dim=1) * spec.clip_ratio
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).to(lay.SCALE_DTYPE)
    y = (xg / scale.float().unsqueeze(1)).clamp(-fmax, fmax)
    return y.to(dtype).view(torch.uint8), scale, None


def _lloyd_max(xg, spec: KVTensorConfig, lay: KVLayout):  # nearest level of x / rms
    rms = xg.pow(2).mean(dim=1).sqrt() * spec.clip_ratio
    scale = torch.where(rms > 0, rms, torch.ones_like(rms)).to(lay.SCALE_DTYPE)
    return assign(xg / scale.float().unsqueeze(1), lay.lut(xg.device)), scale, None


def _fp8_levels(fmt: str, bits: int) -> dict:
    v = torch.arange(256, dtype=torch.uint8).view(_FP8[fmt]).float()
    return {"levels": tuple(torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0).tolist())}


@dataclass(frozen=True)
class KVFormat:
    """One KV format: the bit widths it comes in, the layout fields it stores
    (``layout(fmt, bits)`` -> KVLayout keyword arguments) and its quantizer
    ``quantize(xg, spec, layout)`` -> (codes, scale, zero point or None)."""

    bits: tuple[int, ...]
    layout: Callable[[str, int], dict]
    quantize: Callable


FORMATS: dict[str, KVFormat] = {
    "int": KVFormat((2, 3, 4, 8), lambda fmt, bits: {"zero_const": 2.0 ** (bits - 1)}, _affine),
    "uint": KVFormat((2, 3, 4, 8), lambda fmt, bits: {"has_zero_point": True}, _affine),
    "fp8-e4m3": KVFormat((8,), _fp8_levels, _fp8),
    "fp8-e5m2": KVFormat((8,), _fp8_levels, _fp8),
    "lm": KVFormat((2, 3, 4), lambda fmt, bits: {"levels": tuple(gaussian_codebook(bits).tolist())},
                   _lloyd_max),
}


def check_head_dim(spec: KVTensorConfig, head_dim: int) -> None:
    if not spec.quantized:
        return
    _, dg = spec.group_shape(head_dim)
    if head_dim % dg or (head_dim * spec.bits) % 8 or head_dim % (8 // math.gcd(8, spec.bits)):
        raise ValueError(
            f"head_dim={head_dim} does not fit {spec.format}{spec.bits} with channel group {dg}; "
            "allowed: head_dim a multiple of 8 and of the channel group size"
        )


@lru_cache(maxsize=None)
def kv_layout(spec: KVTensorConfig, head_dim: int) -> KVLayout:
    """The stored layout of a quantized side (``spec``) at ``head_dim`` (one shared object)."""
    if not spec.quantized:
        raise ValueError(f"format {spec.format!r} is stored in full precision and has no KV layout; "
                         f"allowed: {', '.join(FORMATS)}")
    check_head_dim(spec, head_dim)
    tg, dg = spec.group_shape(head_dim)
    fields = FORMATS[spec.format].layout(spec.format, spec.bits)
    if spec.channel_bits:
        if len(spec.channel_bits) != head_dim:
            raise ValueError(f"channel_bits has {len(spec.channel_bits)} entries; allowed: one per channel, "
                             f"head_dim={head_dim}")
        fields["channel_bits"] = spec.channel_bits
    return KVLayout(bits=spec.bits, head_dim=head_dim, channel_group=dg, token_group=tg, **fields)


def encode(x: torch.Tensor, spec: KVTensorConfig, layout: KVLayout | None = None) -> Encoded:
    """Quantize a chunk ``x [B, H, T, D]`` (T a multiple of the token group).

    ``layout``: where the codes go (default ``kv_layout(spec, D)``); another layout must
    agree with the format on bits, groups, zero point and levels and may differ only in
    packing (``ValueError`` otherwise)."""
    B, H, T, D = x.shape
    own = kv_layout(spec, D)
    lay = own if layout is None else layout
    if lay is not own and (lay.bits, lay.head_dim, lay.token_group, lay.channel_group, lay.has_zero_point,
                           lay.zero_const, lay.levels, lay.channel_bits) != (
                               own.bits, own.head_dim, own.token_group, own.channel_group,
                               own.has_zero_point, own.zero_const, own.levels, own.channel_bits):
        raise ValueError(f"layout {lay!r} does not store format {spec.format}{spec.bits} "
                         f"(expected {own!r} up to packing)")
    tg, dg = lay.token_group, lay.channel_group
    if T % tg:
        raise ValueError(f"chunk of {T} tokens; allowed: a multiple of the token group {tg}")
    xf = x.float()
    if tg > 1:  # per-channel groups: (B, H, T/tg, D) of tg tokens each
        xg = xf.view(B, H, T // tg, tg, D).transpose(3, 4).reshape(-1, tg)
    else:  # per-token groups: (B, H, T, D/dg) of dg channels each
        xg = xf.reshape(-1, dg)
    quantize = _affine_channels if spec.channel_bits else FORMATS[spec.format].quantize
    u, scale, zp = quantize(xg, spec, lay)
    if tg > 1:
        # contiguous: with one group (T == tg) reshape returns a strided view, not a copy
        u = u.view(B, H, T // tg, D, tg).transpose(3, 4).reshape(B, H, T, D).contiguous()
    else:
        u = u.view(B, H, T, D)
    qshape = lay.part_shape("scale", B, H, T)
    return Encoded(lay.pack(u), scale.view(qshape), zp.view(qshape) if zp is not None else None)
