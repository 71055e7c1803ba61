"""SmoothQuant (Xiao et al., 2022, arXiv:2211.10438): move activation outliers into weights.

For a norm feeding linears W₁..W_m (input X [T, K]):
    s_j = max|X_j|^α / max_i max_n |W_i[n, j]|^(1−α)
    norm weight ÷ s,   W_i[:, j] × s_j          =>  (X / s) (W · diag(s))ᵀ = X Wᵀ  (exactly)
after which activations are flat enough for int8 per-token and weights for int8
per-channel (W8A8, ``QuantLinear(act_bits=8)``).

Example:
    >>> import torch
    >>> from lessmem.weights.smoothquant import smooth_scale
    >>> s = smooth_scale(torch.tensor([100.0, 1.0]), [torch.tensor([[1.0, 1.0]])], alpha=0.5)
    >>> [round(v, 3) for v in s.tolist()]
    [10.0, 1.0]
"""

from __future__ import annotations

import torch


def smooth_scale(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] from per-channel max|X| and the linears' weights [N_i, K]."""
    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    s = x_absmax.float().clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)
