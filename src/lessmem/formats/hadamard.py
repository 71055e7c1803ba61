"""Randomized Hadamard rotation: spread outliers across a vector before quantizing.

R = H_n · diag(signs) / sqrt(n), with H_n the Sylvester Hadamard matrix and ``signs``
seeded random ±1 (QuaRot, QuIP#). R is orthogonal (R·Rᵀ = I), so ``inverse(rotate(x))
== x`` and dot products are preserved: (R q)·(R k) = q·k, which is why keys can be
rotated before caching when queries are rotated the same way.

The fast Walsh-Hadamard transform costs O(n log n) and needs n a power of two. For
other sizes the rotation is block-diagonal: blocks of the largest power of two that
divides n (576 = 9 × 64 → nine 64-blocks), each with its own signs. When that block
would be smaller than ``min_block`` (16), a seeded dense random orthogonal matrix
(QR of a Gaussian) is used instead, O(n²) but still exact.

Example:
    >>> import torch
    >>> from lessmem.formats.hadamard import HadamardRotation
    >>> r = HadamardRotation(64, seed=0)
    >>> x = torch.randn(3, 64)
    >>> torch.allclose(r.inverse(r.rotate(x)), x, atol=1e-5)
    True
"""

from __future__ import annotations

import math

import torch


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform along the last axis (n a power of 2)."""
    n = x.shape[-1]
    if not is_pow2(n):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, n)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (entries ±1), n a power of two."""
    if not is_pow2(n):
        raise ValueError(f"hadamard_matrix needs a power-of-two size, got {n}")
    return fwht(torch.eye(n))


def largest_pow2_divisor(n: int) -> int:
    return n & (-n)


class HadamardRotation:
    """Seeded orthogonal rotation of the last axis of size ``n``; see the module doc."""

    def __init__(self, n: int, seed: int = 0, min_block: int = 16):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"rotation size n={n!r} must be a positive integer")
        self.n, self.seed = n, seed
        gen = torch.Generator().manual_seed(seed)
        self.signs = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).float()
        self.block = largest_pow2_divisor(n)
        self.dense: torch.Tensor | None = None
        if self.block < min(min_block, n):
            q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
            q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique, Haar-distributed
            self.dense = q.float()
            self.block = n
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def kind(self) -> str:
        if self.dense is not None:
            return "dense-orthogonal"
        return "hadamard" if self.block == self.n else f"block-diagonal hadamard ({self.block})"

    def _on(self, x: torch.Tensor):
        key = (x.device, x.dtype)
        if key not in self._cache:
            d = self.dense.to(x.device, x.dtype) if self.dense is not None else None
            self._cache[key] = (self.signs.to(x.device, x.dtype), d)
        return self._cache[key]

    def _check(self, x: torch.Tensor):
        if x.shape[-1] != self.n:
            raise ValueError(f"rotation is for last-axis size {self.n}, got shape {tuple(x.shape)}")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """y = R x along the last axis."""
        self._check(x)
        signs, dense = self._on(x)
        if dense is not None:
            return x @ dense.T
        y = (x * signs).reshape(*x.shape[:-1], self.n // self.block, self.block)
        return (fwht(y) / math.sqrt(self.block)).reshape(x.shape)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """x = Rᵀ y along the last axis."""
        self._check(y)
        signs, dense = self._on(y)
        if dense is not None:
            return y @ dense
        z = y.reshape(*y.shape[:-1], self.n // self.block, self.block)
        z = (fwht(z) / math.sqrt(self.block)).reshape(y.shape)
        return z * signs

    def matrix(self) -> torch.Tensor:
        """The rotation as a dense [n, n] matrix (rows: R applied to basis vectors)."""
        return self.rotate(torch.eye(self.n)).T
