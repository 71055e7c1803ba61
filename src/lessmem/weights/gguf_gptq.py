"""GPTQ inside GGUF blocks: llama.cpp's scales, codes chosen with error feedback.

``gptq_gguf(w, h, "q4_k")`` returns the raw GGUF rows of ``w [N, K]`` (what a file stores,
decodable by any llama.cpp build) chosen to minimise ``||W X - Ŵ X||²`` for inputs with
Hessian ``h = 2/n · X Xᵀ``, as GPTQ does (Frantar et al., 2022, arXiv:2210.17323; the
solve is ``weights.gptq``'s) but on the block type's own grid:

- columns are visited in order, in lazy batches of ``block_size``; when a (super-)block
  of the type starts (256 columns for K-quants, 32 for the legacy types), its scales and
  mins are chosen by llama.cpp's quantizer (``formats.gguf.quantize_gguf``) from the
  columns *as updated so far*, weighted by the importance of each column (the mean
  squared input, ``diag(h) / 2``, what ``llama-imatrix`` collects), exactly as
  ``llama-quantize --imatrix`` would encode them;
- each column's codes are then the nearest on that fixed grid (``formats.gguf_codes``;
  for IQ4_NL / IQ4_XS the nearest of their 16 non-uniform levels times the block scale),
  and its rounding error is spread over the later columns through the Cholesky factor
  of ``(h + λI)⁻¹``; only the codes differ from the plain encoding, never the layout.

With a diagonal ``h`` no error can be carried and the result is byte for byte
``quantize_gguf(w, t, imatrix=diag(h) / 2)`` for the K-quants (tested); the IQ4 quantizers
pick codes against the scale before its fp16 rounding, so there a few codes may differ.
Float types (F16/F32) are refused (``ValueError``). The legacy weighted
quantizers weigh a block by its whole row's mean square; here a block sees only the row
so far (it is encoded before the later columns are final).

Example:
    >>> import torch
    >>> from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
    >>> _ = torch.manual_seed(0)
    >>> x = torch.randn(2048, 256) @ torch.randn(256, 256) / 16; w = torch.randn(64, 256)
    >>> h = 2 * x.T.double() @ x.double() / x.shape[0]
    >>> err = lambda raw: ((x @ (w - dequantize_gguf(raw, "q3_k", (64, 256))).T) ** 2).mean().item()
    >>> plain = quantize_gguf(w, "q3_k", imatrix=torch.diag(h).float() / 2)
    >>> err(gptq_gguf(w, h.float(), "q3_k")) < 0.8 * err(plain)
    True
"""

from __future__ import annotations

import numpy as np
import torch

from ..formats.gguf import gguf_type, quantize_gguf
from ..formats.gguf_codes import SPECS, codes, grid, nearest_codes, with_codes
from .gptq import _inverse_cholesky


def _check(w, h, qtype, damp, block_size):
    t = gguf_type(qtype)
    if t.name not in SPECS:
        raise ValueError(f"gptq_gguf: GGUF type {t.name.upper()} has no integer grid for GPTQ; "
                         f"allowed: {', '.join(n.upper() for n in SPECS)}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"gptq_gguf: w must be a 2-D weight tensor [out, in], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    n, k = w.shape
    if k % t.block_size:
        raise ValueError(f"gptq_gguf: {t.name.upper()} encodes rows in blocks of {t.block_size}; "
                         f"the weight has {k} columns")
    if not isinstance(h, torch.Tensor) or tuple(h.shape) != (k, k):
        got = list(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"gptq_gguf: h must be the [in, in] = [{k}, {k}] Hessian of the layer's inputs, got {got}")
    if not (isinstance(damp, (int, float)) and 0 < damp < 1):
        raise ValueError(f"gptq_gguf: damp={damp!r}; allowed: a number in (0, 1), e.g. 0.01")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"gptq_gguf: block_size={block_size!r}; allowed: an int >= 1")
    return t, n, k


def gptq_gguf(w: torch.Tensor, h: torch.Tensor, qtype, damp: float = 0.01,
              block_size: int = 256) -> np.ndarray:
    """Raw GGUF rows ``[N, K / block * type_size]`` of ``w`` (see the module doc)."""
    t, n, k = _check(w, h, qtype, damp, block_size)
    bs = t.block_size
    W = w.detach().double().cpu().clone()
    H = h.detach().double().cpu().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    importance = (torch.diag(h.detach().double().cpu()) / 2).float().numpy()  # mean x² per column
    U = _inverse_cholesky(H, damp)
    out = np.empty((n, k // bs * t.type_size), dtype=np.uint8)
    step = (max(block_size, bs) + bs - 1) // bs * bs  # a block never straddles two batches
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for b0 in range(0, i2 - i1, bs):
            col0 = i1 + b0
            raw = quantize_gguf(W1[:, b0:b0 + bs].float().numpy(), t, imatrix=importance[col0:col0 + bs])
            g = grid(raw, t)
            u = codes(raw, t)
            for j in range(bs):
                i = b0 + j
                col, gj = W1[:, i], _column(g, j)
                u[:, j] = nearest_codes(col.float().numpy(), gj, u[:, j])
                q = torch.from_numpy(gj.decode(u[:, j], np.float64))
                e = (col - q) / U1[i, i]
                W1[:, i:] -= e[:, None] * U1[i:i + 1, i:]
                Err[:, i] = e
            lo = col0 // bs * t.type_size
            out[:, lo:lo + t.type_size] = with_codes(raw, t, u)
        W[:, i2:] -= Err @ U[i1:i2, i2:]
    return out


def _column(g, j: int):
    return g._replace(d=g.d[:, j], m=g.m[:, j])


__all__ = ["gptq_gguf"]
