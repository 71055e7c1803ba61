"""The torch fallback of the fused GGUF dequant-matmul (production path without the C++ kernel).

``gguf_linear_cpp`` calls these when no compiler is available or when the tensors are not
on the CPU. The raw GGUF blocks (uint8 ``[N, K / block_size * type_size]``) are decoded with
torch byte and float32 ops on the tensor's own device, so a weight held on a GPU is
decoded there and nothing goes through numpy. The decoders do the float32 operations of
``formats.gguf.dequantize_gguf`` (``formats.gguf_legacy`` / ``formats.gguf_kquants``) in the
same order (``d·(q − 8)``, ``d·q + m``, ``(d·sc)·q − (dmin·m)`` …, each one rounding), so the
weights are bit-identical to theirs; the layouts are described there and in ``formats.gguf``.

``gguf_linear_torch`` decodes at most ``CHUNK_WEIGHTS`` weights at a time (one slice of
output rows after another) and multiplies each slice in float32, so the whole float matrix
is never held. The test oracle it is checked against is ``gguf_linear_reference`` (numpy
decoders, float64 matmul); production code never imports it.

Example:
    >>> import torch
    >>> from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
    >>> raw = torch.from_numpy(quantize_gguf(torch.randn(4, 256), "q4_k"))
    >>> w = gguf_dequantize_torch(raw, "q4_k", 4)
    >>> torch.equal(w, dequantize_gguf(raw, "q4_k", (4, 256)))
    True
"""

from __future__ import annotations

import torch

from ..formats.gguf import gguf_type
from .linear_torch import row_slices

QK_K = 256  # K-quant super-block size


def _fp16_at(r: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte ``off`` of each block, as float32 [B, 1]."""
    return r[:, off:off + 2].contiguous().view(torch.float16).float()


def _shifts(r: torch.Tensor, step: int) -> torch.Tensor:
    """Bit shifts 0, step, 2·step … below 8, made on r's device (no copy from the host)."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=r.device)


def _bits_of(r: torch.Tensor) -> torch.Tensor:
    """[B, n] bytes -> [B, 8n] bits (0/1): bit j of byte i at 8i + j (little bit order)."""
    return ((r[:, :, None] >> _shifts(r, 1)) & 1).reshape(r.shape[0], -1)


def _bit_planes(r: torch.Tensor) -> torch.Tensor:
    """[B, 32] bytes -> [B, 256] bits (0/1): bit j of byte l at 32j + l (the K-quants' high bits)."""
    return ((r[:, None, :] >> _shifts(r, 1).view(1, 8, 1)) & 1).reshape(r.shape[0], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] codes: low nibbles first, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


# ---------------------------------------------------------------- legacy blocks of 32

def _q4_0(r):
    return _fp16_at(r, 0) * (_nibbles(r[:, 2:18]).float() - 8)


def _q4_1(r):
    return _fp16_at(r, 0) * _nibbles(r[:, 4:20]).float() + _fp16_at(r, 2)


def _q5_0(r):
    q = _nibbles(r[:, 6:22]) | (_bits_of(r[:, 2:6]) << 4)
    return _fp16_at(r, 0) * (q.float() - 16)


def _q5_1(r):
    q = _nibbles(r[:, 8:24]) | (_bits_of(r[:, 4:8]) << 4)
    return _fp16_at(r, 0) * q.float() + _fp16_at(r, 2)


def _q8_0(r):
    return r[:, 2:34].contiguous().view(torch.int8).float() * _fp16_at(r, 0)


# ---------------------------------------------------------------- K-quants (super-blocks of 256)

def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """[B, 64] bytes -> [B, 256] codes 0..3: byte 32h + l holds code 128h + 32k + l at bits 2k."""
    return ((qs.reshape(-1, 2, 1, 32) >> _shifts(qs, 2).view(1, 1, 4, 1)) & 3).reshape(-1, QK_K)


def _four_bit(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 256] codes: per 32 bytes, the low nibbles then the high ones."""
    return ((qs.reshape(-1, 4, 1, 32) >> _shifts(qs, 4).view(1, 1, 2, 1)) & 0x0F).reshape(-1, QK_K)


def _q2_k(r):
    sc = r[:, :16]
    dl = (_fp16_at(r, 80) * (sc & 0x0F).float())[:, :, None]
    ml = (_fp16_at(r, 82) * (sc >> 4).float())[:, :, None]
    q = _two_bit(r[:, 16:80]).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1, QK_K)


def _q3_k(r):
    s = r[:, 96:108]
    low = torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=1)
    high = (s[:, 8:12].reshape(-1, 1, 4) >> _shifts(r, 2).view(1, 4, 1)) & 3
    sc = (low | (high.reshape(-1, 16) << 4)).float() - 32
    dl = (_fp16_at(r, 108) * sc)[:, :, None]
    q = _two_bit(r[:, 32:96]).float() - ((_bit_planes(r[:, :32]) ^ 1) << 2).float()
    return (dl * q.reshape(-1, 16, 16)).reshape(-1, QK_K)


def _k4_scales(s: torch.Tensor):
    """12 bytes -> (scales [B, 8], mins [B, 8]), six bits each (ggml ``get_scale_min_k4``)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, mn


def _q45_k(r, q):
    sc, mn = _k4_scales(r[:, 4:16])
    d = (_fp16_at(r, 0) * sc.float())[:, :, None]
    dm = (_fp16_at(r, 2) * mn.float())[:, :, None]
    return (d * q.reshape(-1, 8, 32).float() - dm).reshape(-1, QK_K)


def _q4_k(r):
    return _q45_k(r, _four_bit(r[:, 16:144]))


def _q5_k(r):
    high = _bit_planes(r[:, 16:48])
    return _q45_k(r, _four_bit(r[:, 48:176]) | (high << 4))


def _q6_k(r):
    ql, qh = r[:, :128], r[:, 128:192]
    d = (_fp16_at(r, 208) * r[:, 192:208].contiguous().view(torch.int8).float())[:, :, None]
    low = ((ql.reshape(-1, 2, 1, 64) >> _shifts(r, 4).view(1, 1, 2, 1)) & 0x0F).reshape(-1, 2, 4, 32)
    high = (qh.reshape(-1, 2, 1, 32) >> _shifts(r, 2).view(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).float() - 32
    return (d * q.reshape(-1, 16, 16)).reshape(-1, QK_K)


# ---------------------------------------------------------------- IQ4_NL / IQ4_XS (formats.gguf_iquants)

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16k] bytes -> [B, 32k] float32 table levels, per run of 32: low nibbles, then high."""
    table = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=qs.device)
    n = qs.shape[0]
    idx = qs.reshape(n, -1, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return table[(idx & 0x0F).long()].reshape(n, -1)


def _iq4_nl(r):
    return _fp16_at(r, 0) * _iq4_levels(r[:, 2:18])


def _iq4_xs(r):
    sh = r[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # [B, 1], little-endian u16
    sl = r[:, 4:8].int()
    ib = torch.arange(8, device=r.device)
    ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)
    dl = (_fp16_at(r, 0) * (ls - 32).float())[:, :, None]
    return (dl * _iq4_levels(r[:, 8:136]).reshape(-1, 8, 32)).reshape(-1, QK_K)


DECODERS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
            "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
            "iq4_nl": _iq4_nl, "iq4_xs": _iq4_xs}


def decode_rows(raw: torch.Tensor, t, rows: int) -> torch.Tensor:
    """float32 ``[rows, K]`` from the raw GGUF blocks of ``rows`` rows (any shape), on raw's device."""
    blocks = raw.reshape(-1, t.type_size)
    return DECODERS[t.name](blocks).reshape(rows, -1)


def gguf_dequantize_torch(raw: torch.Tensor, qtype, out_features: int) -> torch.Tensor:
    """float32 ``W_hat [N, K]`` decoded on raw's device, bit-identical to ``dequantize_gguf``."""
    return decode_rows(raw, gguf_type(qtype), int(out_features))


def gguf_linear_torch(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W_hat.T (+ bias)`` in x's dtype (float32 sums), W as raw GGUF rows [N, row_bytes].

    The blocks are decoded on raw's device, one slice of rows at a time, and multiplied on
    x's device."""
    t = gguf_type(qtype)
    n, k = int(out_features), x.shape[-1]
    x2 = x.reshape(-1, k).float()
    rows = raw.reshape(n, -1)
    y = x2.new_empty(x2.shape[0], n)
    for r0, r1 in row_slices(n, k):
        y[:, r0:r1] = x2 @ decode_rows(rows[r0:r1], t, r1 - r0).to(x2.device).T
    if bias is not None:
        y += bias.to(y.device).float().reshape(-1)
    return y.view(*x.shape[:-1], n).to(x.dtype)
