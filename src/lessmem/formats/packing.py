"""Dense bit packing of unsigned integer codes into uint8.

Layout (little-endian bit stream): code ``i`` occupies bits ``[b*i, b*i + b)`` of the
stream, and byte ``j`` holds stream bits ``[8j, 8j + 8)``. So 4-bit packs two codes per
byte (low nibble first), 2-bit four per byte, 3-bit eight codes in three bytes, 5-bit
eight in five, 6-bit four in three. The stream is padded with zero codes to a whole
number of bytes; ``unpack_bits`` needs the code count back.

Example:
    >>> import torch
    >>> from lessmem.formats.packing import pack_bits, unpack_bits
    >>> c = torch.tensor([1, 7, 3, 0, 5, 2, 6, 4], dtype=torch.uint8)
    >>> p = pack_bits(c, 3); p.numel()
    3
    >>> torch.equal(unpack_bits(p, 3, 8), c)
    True
"""

from __future__ import annotations

import math

import torch

from ._checks import check_bits

PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def packed_nbytes(n_codes: int, bits: int) -> int:
    """Bytes needed for ``n_codes`` codes of ``bits`` bits (padded to whole bytes)."""
    return math.ceil(n_codes * bits / 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a tensor of unsigned codes (< 2**bits) into a flat uint8 tensor."""
    check_bits(bits, PACK_BITS)
    flat = codes.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.to(torch.uint8)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    if bits in (1, 2, 4):  # whole codes per byte: shift-or within each byte
        per = 8 // bits
        pad = (-n) % per
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        v = flat.view(-1, per).to(torch.int32)
        out = torch.zeros(v.shape[0], dtype=torch.int32, device=flat.device)
        for i in range(per):
            out |= v[:, i] << (bits * i)
        return out.to(torch.uint8)
    # 3, 5, 6, 7 bits: 8 codes make exactly `bits` bytes; assemble a 64-bit word
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    v = flat.view(-1, 8).to(torch.int64)
    word = torch.zeros(v.shape[0], dtype=torch.int64, device=flat.device)
    for i in range(8):
        word |= v[:, i] << (bits * i)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], dim=1).to(torch.uint8)
    return out.reshape(-1)[: packed_nbytes(n, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat uint8 tensor of ``n_codes`` codes."""
    check_bits(bits, PACK_BITS)
    p = packed.reshape(-1)
    need = packed_nbytes(n_codes, bits)
    if p.numel() < need:
        raise ValueError(
            f"packed buffer has {p.numel()} bytes but {n_codes} codes of {bits} bits need {need}"
        )
    if bits == 8:
        return p[:n_codes].clone()
    if bits in (1, 2, 4):
        per = 8 // bits
        mask = (1 << bits) - 1
        v = p.to(torch.int32)
        out = torch.stack([(v >> (bits * i)) & mask for i in range(per)], dim=1)
        return out.reshape(-1)[:n_codes].to(torch.uint8)
    n_words = math.ceil(n_codes / 8)
    buf = p
    if buf.numel() < n_words * bits:
        buf = torch.cat([buf, buf.new_zeros(n_words * bits - buf.numel())])
    b = buf[: n_words * bits].view(n_words, bits).to(torch.int64)
    word = torch.zeros(n_words, dtype=torch.int64, device=p.device)
    for j in range(bits):
        word |= b[:, j] << (8 * j)
    mask = (1 << bits) - 1
    out = torch.stack([(word >> (bits * i)) & mask for i in range(8)], dim=1)
    return out.reshape(-1)[:n_codes].to(torch.uint8)
