"""Inputs the kernel tests share: packed low-bit weights and GGUF block rows."""

from __future__ import annotations

import numpy as np
import torch

from lessmem.formats.gguf import gguf_type, quantize_gguf
from lessmem.formats.packing import pack_bits


def lowbit_case(bits, n, k, gs, sym, seed):
    """(codes u [n, k], packed codes, fp16 scales, uint8 zero points) of a random weight."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // gs, generator=g) / 10 + 1e-3).half()
    if sym:
        zero = torch.full((n, k // gs), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zero = torch.randint(0, 2**bits, (n, k // gs), dtype=torch.uint8, generator=g)
    return u, pack_bits(u, bits), scale, zero


def gguf_rows(t, n, k, seed):
    """Raw GGUF rows of type ``t`` quantized from a random weight whose rows differ in scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return torch.from_numpy(quantize_gguf(w, t))


def random_gguf_blocks(t, n, k, seed):
    """Random bytes for every field (all code bits, scale bits, signs), finite fp16 scales;
    a subnormal and exact zeros among them, which must decode like the reference."""
    gt = gguf_type(t)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // gt.block_size, gt.type_size), dtype=np.uint8)
    for off in gt.fp16_offsets:
        v = rng.uniform(-2, 2, size=blocks.shape[0]).astype(np.float16)
        v[::7] = np.float16(6e-6)
        v[::11] = 0
        blocks[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))
