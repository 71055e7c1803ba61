"""AWQ (Lin et al., 2023, arXiv:2306.00978): activation-aware scaling, then clipping.

For a scaling group (a preceding op P feeding linears W₁..W_m with input X [T, K]):
    s(α) = mean|X|^α / sqrt(max · min)           (per input channel, α on a grid in [0, 1))
    loss(α) = || f(X) − f_q(X / s) ||²,  f_q: the inspected sub-module with each
              W_i replaced by Q(W_i · diag(s))   (Q: round-to-nearest in groups)
The best s is folded exactly: P's output channels ÷ s (norm weight, or rows of a
preceding linear) and W_i's input columns × s, so the float model is unchanged and
the salient channels (large mean|x|) get finer quantization steps.

Then, per linear and per weight group, the clipping search keeps the ratio r ∈
[1 − max_shrink, 1] minimising ||X_g (W_g − Q_r(W_g))ᵀ||² on kept calibration tokens.
(q/k projections are not clipped: their errors meet in the attention softmax.)

Example: see ``tests/weights/test_algorithms.py`` (AWQ output error ≤ RTN's).
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import get_module
from .rtn import fake_quant, group_qparams


def _fq_weight(w: torch.Tensor, bits: int, gs: int, symmetric: bool, clip=None) -> torch.Tensor:
    n, k = w.shape
    wg = w.float().reshape(-1, gs)
    s, z = group_qparams(wg, bits, symmetric, clip)
    return fake_quant(wg, s, z, bits).view(n, k)


def _inspect(block, name: str, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    mod = get_module(block, name)
    with torch.no_grad():
        if name.endswith("self_attn") or name == "self_attn":
            return mod(hidden_states=x, **kwargs)[0]
        return mod(x)


def search_scale(block, group, linears: dict, cfgs: dict, x: torch.Tensor, kwargs: dict,
                 n_grid: int, quantizer=None) -> tuple[torch.Tensor, float, float]:
    """Best per-channel scale s [K] for a group; returns (s, best loss, loss at α=0).

    ``quantizer(name, w_scaled, s) -> fake-quantized w_scaled``: Q above (default: RTN in
    groups with ``cfgs[name]``'s bits, group size and symmetry; GGUF passes its block type)."""
    if quantizer is None:
        def quantizer(n, ws, s):
            c = cfgs[n]
            return _fq_weight(ws, c.bits, c.group_size, c.symmetric)
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    ref = _inspect(block, group.inspect, x, kwargs)
    orig = {n: m.weight.data.clone() for n, m in linears.items()}
    best, best_s, loss0 = float("inf"), torch.ones_like(x_mean), None
    try:
        for i in range(n_grid):
            alpha = i / n_grid
            s = x_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for n, m in linears.items():
                m.weight.data = (quantizer(n, orig[n] * s, s) / s).to(orig[n].dtype)
            loss = (_inspect(block, group.inspect, x, kwargs) - ref).float().pow(2).mean().item()
            if i == 0:
                loss0 = loss
            if loss < best:
                best, best_s = loss, s.clone()
    finally:
        for n, m in linears.items():
            m.weight.data = orig[n]
    return best_s, best, loss0


def fold_scale(block, group, s: torch.Tensor) -> None:
    """prev output channels ÷ s, the input columns of every linear of the group × s (exact in
    float; one left float by a skip pattern reads the same ``prev``, so it is scaled too)."""
    linears = [get_module(block, n) for n in group.linears]
    prev = get_module(block, group.prev)
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:  # RMSNorm / LayerNorm: y = w ⊙ x̂ (+ b)
            prev.weight.div_(s.to(prev.weight.dtype))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        for m in linears:
            m.weight.mul_(s.view(1, -1).to(m.weight.dtype))


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, gs: int, symmetric: bool,
                max_shrink: float, n_ratios: int = 10, chunk: int = 256) -> torch.Tensor:
    """Per-group clip ratios [N, G] minimising ||X_g (W_g − Q_r(W_g))ᵀ||² (x: [T, K] tokens)."""
    n, k = w.shape
    G = k // gs
    xg = x.float().view(-1, G, gs).permute(1, 0, 2)  # [G, T, gs]
    ratios = torch.linspace(1.0, 1.0 - max_shrink, n_ratios, device=w.device)
    best_r = torch.ones(n, G, device=w.device)
    for r0 in range(0, n, chunk):
        wc = w[r0:r0 + chunk].float()
        rows = wc.shape[0]
        wg = wc.reshape(-1, gs)  # [rows*G, gs]
        best_err = torch.full((rows, G), float("inf"), device=w.device)
        for r in ratios:
            s, z = group_qparams(wg, bits, symmetric, torch.full((wg.shape[0],), float(r), device=w.device))
            d = (wg - fake_quant(wg, s, z, bits)).view(rows, G, gs).permute(1, 2, 0)  # [G, gs, rows]
            err = torch.bmm(xg, d).pow(2).mean(1).T  # [rows, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_r[r0:r0 + rows] = torch.where(better, r, best_r[r0:r0 + rows])
    return best_r
