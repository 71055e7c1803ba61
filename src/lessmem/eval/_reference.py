"""Slow, obviously-correct twins of the evaluator's metrics (for tests).

``reference_ppl`` scores the same tokens as the protocol (``P..N-1`` of each window)
from one full forward pass per window without any cache; the protocol's
``DynamicCache`` baseline must agree with it to float tolerance.
``reference_kld`` is KL(p || q) computed from probabilities, not log-probabilities.
"""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def reference_ppl(model, windows: torch.Tensor, prefill: int) -> float:
    """exp(mean NLL) of tokens ``prefill..N-1`` of each row of ``windows`` [K, N]."""
    nll, n = 0.0, 0
    for row in windows:
        logits = model(row[None], use_cache=False).logits[0].double()  # [N, V]
        logp = torch.log_softmax(logits, -1)
        for t in range(prefill, row.numel()):
            nll -= float(logp[t - 1, row[t]])  # logits at t-1 predict token t
            n += 1
    return math.exp(nll / n)


def reference_kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over rows of sum_v p(v) log(p(v) / q(v)) (rows of [T, V] logits)."""
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    terms = torch.where(p > 0, p * torch.log(p / q), torch.zeros_like(p))
    return float(terms.sum(-1).mean())
