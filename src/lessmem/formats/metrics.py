"""Error metrics between a tensor and its reconstruction."""

from __future__ import annotations

import math

import torch


def snr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-noise ratio in dB: 10·log10(Σx² / Σ(x - x̂)²); inf when exact."""
    x64, e = x.double(), (x.double() - x_hat.double())
    noise = float((e * e).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(float((x64 * x64).sum()) / noise)


def error_stats(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """max abs error, mean abs error, max relative error (over nonzero x), SNR in dB."""
    e = (x.double() - x_hat.double()).abs()
    nz = x.double().abs() > 0
    rel = (e[nz] / x.double().abs()[nz]).max().item() if nz.any() else 0.0
    return {
        "max_abs_err": e.max().item(),
        "mean_abs_err": e.mean().item(),
        "max_rel_err": rel,
        "snr_db": snr_db(x, x_hat),
    }
