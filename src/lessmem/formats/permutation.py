"""A fixed reordering of a tensor's last axis, usable wherever a KV rotation is.

The KV cache stores a layer's keys with their channels sorted by the bits each one gets
(``KVTensorConfig.channel_bits``, calibrated by :mod:`lessmem.eval.channels`); the
queries are reordered the same way, so every score ``q·k`` is unchanged. A permutation
is an orthogonal matrix, so it has the interface of
:class:`~lessmem.formats.hadamard.HadamardRotation` (``rotate``, ``inverse``, ``n``).

Example:
    >>> import torch
    >>> p = channel_permutation((2, 0, 1))
    >>> p.rotate(torch.tensor([10., 11., 12.])).tolist()
    [12.0, 10.0, 11.0]
    >>> p.inverse(p.rotate(torch.tensor([10., 11., 12.]))).tolist()
    [10.0, 11.0, 12.0]
"""

from __future__ import annotations

from functools import lru_cache

import torch


class ChannelPermutation:
    """``rotate(x)[..., i] = x[..., order[i]]``; ``inverse`` undoes it."""

    kind = "channel permutation"

    def __init__(self, order: tuple[int, ...]):
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"order={order!r}; allowed: a permutation of 0..{len(order) - 1}")
        self.order = tuple(order)
        self.n = len(order)
        self.seed = None  # (read by code that tells rotations apart; a permutation has none)
        self.block = self.n
        self._idx: dict = {}

    def _index(self, device, inverse: bool) -> torch.Tensor:
        key = (torch.device(device), inverse)
        t = self._idx.get(key)
        if t is None:
            t = torch.tensor(self.order, dtype=torch.long)
            if inverse:
                t = torch.argsort(t)
            t = self._idx[key] = t.to(device)
        return t

    def _check(self, x: torch.Tensor):
        if x.shape[-1] != self.n:
            raise ValueError(f"permutation is for last-axis size {self.n}, got shape {tuple(x.shape)}")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return x.index_select(-1, self._index(x.device, False))

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        self._check(y)
        return y.index_select(-1, self._index(y.device, True))

    def matrix(self) -> torch.Tensor:
        """As a dense [n, n] matrix R (``rotate(x) = x @ Rᵀ``)."""
        return self.rotate(torch.eye(self.n)).T


@lru_cache(maxsize=None)
def channel_permutation(order: tuple[int, ...]) -> ChannelPermutation:
    """One shared object per order: caches (and a serving step's requests) that store a
    layer the same way hold the same permutation, as they hold the same rotation."""
    return ChannelPermutation(tuple(order))
