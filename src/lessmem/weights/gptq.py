"""GPTQ solve (Frantar et al., 2022, arXiv:2210.17323) for one linear, given H.

Minimises ||W X − Ŵ X||² column by column: quantize column j, then spread its error
e_j = (w_j − ŵ_j) / [H⁻¹]_jj over the later columns through the upper Cholesky factor
of H⁻¹ (rows of U = chol(H⁻¹)ᵀ), in blocks of ``block_size`` columns with lazy batch
updates of the columns right of the block:  W[:, j:] −= e_j · U[j, j:].

- damping: H += λ·I, λ = damp·mean(diag H), retried ×10 while Cholesky fails
- dead inputs (H_jj = 0): weight column zeroed, H_jj = 1
- act_order: columns in order of decreasing H_jj; static_groups: each group's scale and
  zero point fixed from the unmodified weight before the solve (needed with act_order)
- groups: parameters of group g chosen when its first column is reached, from the
  columns as updated so far

Example:
    >>> import torch
    >>> from lessmem.weights.gptq import gptq_quantize
    >>> from lessmem.weights.rtn import rtn_quantize
    >>> _ = torch.manual_seed(0); x = torch.randn(512, 64) @ torch.randn(64, 64); w = torch.randn(32, 64)
    >>> h = 2 * x.T.double() @ x.double() / 512
    >>> qg = gptq_quantize(w, h.float(), bits=3, group_size=32, symmetric=False)
    >>> qr = rtn_quantize(w, 3, 32, False)
    >>> err = lambda q: ((x @ (w - q.dequantize()).T) ** 2).mean().item()
    >>> err(qg) < err(qr)
    True
"""

from __future__ import annotations

import torch

from .rtn import (
    QuantizedWeight,
    check_group_size,
    check_weight,
    dequantize_grouped,
    group_qparams,
    quantize_grouped,
)


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, raising λ ×10 while the factorisation fails."""
    k = h.shape[0]
    lam = damp * torch.diag(h).mean().item()
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(h + lam * eye)
        if info.item() == 0:
            hinv = torch.cholesky_inverse(L)
            U, info2 = torch.linalg.cholesky_ex(hinv, upper=True)
            if info2.item() == 0:
                return U
        lam = max(lam * 10, 1e-8)
    raise ValueError(f"GPTQ: Hessian not positive definite even with damping {lam:.3g}; "
                     "use more calibration text or a larger damp")


def _check_args(w, h, bits, group_size, act_order, static_groups) -> tuple[int, int, int]:
    """``(N, K, group size)``, or a ValueError naming the argument that cannot work."""
    n, k = check_weight(w, bits)
    gs = check_group_size(group_size, k)
    if not isinstance(h, torch.Tensor) or tuple(h.shape) != (k, k):
        got = list(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"h must be the [in, in] = [{k}, {k}] Hessian of the layer's inputs, got {got}")
    if act_order and not static_groups and group_size is not None:
        # a group's parameters would be chosen at its first column in permuted order, then
        # read by columns of the other groups before they are set: groups must be fixed first
        raise ValueError("gptq_quantize act_order=True with group_size set needs "
                         "static_groups=True (or group_size=None)")
    return n, k, gs


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None,
                  symmetric: bool, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False, static_groups: bool = False) -> QuantizedWeight:
    n, k, gs = _check_args(w, h, bits, group_size, act_order, static_groups)
    W = w.detach().double().clone()  # [N, K]; float64 keeps the solve stable for big K
    H = h.detach().double().to(W.device, copy=True)  # (solved where the weight is)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    G = k // gs
    scale = torch.empty(n, G, dtype=torch.float16, device=W.device)
    zero = torch.empty(n, G, dtype=torch.uint8, device=W.device)
    if static_groups or group_size is None:
        for g in range(G):
            s, z = group_qparams(W[:, g * gs:(g + 1) * gs].float(), bits, symmetric)
            scale[:, g], zero[:, g] = s, z
    perm = torch.arange(k, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp)
    codes = torch.empty(n, k, dtype=torch.uint8, device=W.device)  # in permuted column order
    group_of = (perm // gs).tolist()  # (host ints: no device sync per column)
    dynamic = not (static_groups or group_size is None)
    bs = block_size
    if dynamic:
        bs = (max(block_size, gs) + gs - 1) // gs * gs  # a group never straddles two blocks
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % gs == 0:
                s, z = group_qparams(W1[:, i:i + gs].float(), bits, symmetric)
                scale[:, col // gs], zero[:, col // gs] = s, z
            g = group_of[col]
            s, z = scale[:, g], zero[:, g]
            wc = W1[:, i:i + 1].float()
            u = quantize_grouped(wc, s, z, bits)  # [N, 1]
            q = dequantize_grouped(u, s, z, bits).double()
            codes[:, col] = u[:, 0]
            e = (W1[:, i:i + 1] - q) / U1[i, i]
            W1[:, i:] -= e * U1[i:i + 1, i:]
            Err[:, i:i + 1] = e
        W[:, i2:] -= Err @ U[i1:i2, i2:]
    if act_order:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
    return QuantizedWeight(codes.contiguous(), scale, zero, bits, gs, symmetric)
