"""Observe: per-linear input statistics gathered by forward hooks in one pass.

For a linear with input ``x [T, K]`` (tokens flattened) an ``Observer`` accumulates

- ``xtx``   Σ_t x_t x_tᵀ  [K, K] float64      (GPTQ: H = 2/n · XXᵀ)
- ``abs_sum`` Σ_t |x_t|   [K]                 (AWQ: mean|x| per channel)
- ``abs_max`` max_t |x_t| [K]                 (SmoothQuant: max|X_j|)
- ``samples`` up to ``keep`` tokens of x       (AWQ's clipping search)

so GPTQ, AWQ and SmoothQuant all read the same pass (observe, then solve).

Example:
    >>> import torch
    >>> from lessmem.weights.observer import Observer
    >>> ob = Observer(4, want_xtx=True)
    >>> ob.add(torch.ones(3, 4))
    >>> ob.n, ob.hessian()[0, 0].item(), ob.mean_abs().tolist()
    (3, 2.0, [1.0, 1.0, 1.0, 1.0])
"""

from __future__ import annotations

import torch


class Observer:
    """Statistics of one linear's inputs, held on the device of the first input seen (a model
    calibrated on a GPU keeps them there)."""

    def __init__(self, in_features: int, want_xtx: bool = False, keep: int = 0):
        self.k = in_features
        self.n = 0
        self.want_xtx = want_xtx
        # allocated by the first input, on its device (read before any: zeros on the CPU)
        self.xtx = self.abs_sum = self._abs_max = None
        self.keep = keep
        self._kept: list[torch.Tensor] = []
        self._n_kept = 0

    def _start(self, device: torch.device) -> None:
        if self.abs_sum is not None:
            return
        k = self.k
        self.xtx = torch.zeros(k, k, dtype=torch.float64, device=device) if self.want_xtx else None
        self.abs_sum = torch.zeros(k, dtype=torch.float64, device=device)
        self._abs_max = torch.zeros(k, device=device)

    @property
    def abs_max(self) -> torch.Tensor:
        self._start(torch.device("cpu"))  # (a linear no input reached, e.g. an unrouted expert)
        return self._abs_max

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.k).float()
        self._start(x.device)
        self.n += x.shape[0]
        if self.xtx is not None:
            xd = x.double()
            self.xtx += xd.T @ xd
        a = x.abs()
        self.abs_sum += a.sum(0).double()
        self._abs_max = torch.maximum(self._abs_max, a.amax(0))
        if self._n_kept < self.keep:
            take = x[: self.keep - self._n_kept]
            self._kept.append(take.clone())
            self._n_kept += take.shape[0]

    def hessian(self) -> torch.Tensor:
        """H = 2/n · Σ x xᵀ  (float32 [K, K])."""
        self._start(torch.device("cpu"))
        return (2.0 / max(self.n, 1) * self.xtx).float()

    def mean_abs(self) -> torch.Tensor:
        self._start(torch.device("cpu"))
        return (self.abs_sum / max(self.n, 1)).float()

    def samples(self) -> torch.Tensor:
        return torch.cat(self._kept) if self._kept else torch.zeros(0, self.k)


class StopForward(Exception):
    """Raised by a hook once every observed module has seen its input (skip the rest)."""


def observe(modules: dict, run, want_xtx: bool = False, keep: int = 0,
            stop_early: bool = False) -> dict[str, Observer]:
    """Hook ``modules`` ({name: nn.Linear}), call ``run(stop_early)``, return {name: Observer}.

    With ``stop_early`` the hooks raise ``StopForward`` as soon as all modules have seen
    this forward's input; ``run`` catches it per sample (GPTQ's true-sequential stages
    only need the block up to the stage being solved).
    """
    obs = {n: Observer(m.in_features, want_xtx, keep) for n, m in modules.items()}
    seen: set[str] = set()

    def hook(mod, inp, n):
        obs[n].add(inp[0])
        seen.add(n)
        if stop_early and len(seen) == len(obs):
            seen.clear()
            raise StopForward

    handles = [m.register_forward_pre_hook(lambda mod, inp, n=n: hook(mod, inp, n))
               for n, m in modules.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return obs
