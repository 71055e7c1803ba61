"""A fixed reordering of a tensor's last axis, usable wherever a KV rotation is.

The KV cache stores a layer's keys with their channels sorted by the bits each one gets
(``KVTensorConfig.channel_bits``, calibrated by :mod:`lessmem.eval.channels`); the
queries are reordered the same way, so every score ``q·k`` is unchanged. A permutation
is an orthogonal matrix, so it has the interface of
:class:`~lessmem.formats.hadamard.HadamardRotation` (``rotate``, ``inverse``, ``n``).

Example:
    >>> import torch
    >>> p = channel_permutation((2, 0, 1), 3)
    >>> p.rotate(torch.tensor([10., 11., 12.])).tolist()
    [12.0, 10.0, 11.0]
    >>> p.inverse(p.rotate(torch.tensor([10., 11., 12.]))).tolist()
    [10.0, 11.0, 12.0]
"""

from __future__ import annotations

from functools import lru_cache

import torch


class ChannelPermutation:
    """``rotate(x)[..., i] = x[..., order[i]]``; ``inverse`` undoes it.

    ``orders``: one order per KV head, or one for all (``per_head`` False). With one order
    per head, ``x`` has its heads on axis −3 (``[..., H, T, n]``): KV heads, or query heads
    (H a multiple of the KV heads: query head h uses KV head h // (H / KV heads)).
    """

    def __init__(self, orders: tuple[tuple[int, ...], ...]):
        n = len(orders[0]) if orders else 0
        for o in orders:
            if sorted(o) != list(range(n)):
                raise ValueError(f"order={o!r}; allowed: a permutation of 0..{n - 1}")
        self.orders = tuple(tuple(o) for o in orders)
        self.n, self.heads = n, len(orders)
        self.per_head = self.heads > 1
        self._idx: dict = {}

    def _index(self, device, inverse: bool, heads: int) -> torch.Tensor:
        """[n] (one order) or [heads, n] gather indices (cached)."""
        key = (torch.device(device), inverse, heads if self.per_head else 1)
        t = self._idx.get(key)
        if t is None:
            t = torch.tensor(self.orders, dtype=torch.long)
            if inverse:
                t = torch.argsort(t, dim=-1)
            if self.per_head:
                if heads % self.heads:
                    raise ValueError(f"{heads} heads on axis -3; allowed: a multiple of the permutation's "
                                     f"{self.heads} KV heads")
                t = t.repeat_interleave(heads // self.heads, 0)
            else:
                t = t[0]
            t = self._idx[key] = t.to(device)
        return t

    def _apply(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        if x.shape[-1] != self.n or (self.per_head and x.dim() < 3):
            want = "[..., H, T, n]" if self.per_head else "[..., n]"
            raise ValueError(f"permutation is for {want} with n={self.n}, got shape {tuple(x.shape)}")
        if not self.per_head:
            return x.index_select(-1, self._index(x.device, inverse, 1))
        idx = self._index(x.device, inverse, x.shape[-3])  # [H, n]
        return torch.gather(x, -1, idx.unsqueeze(-2).expand(x.shape))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, False)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return self._apply(y, True)

    def transposed(self, heads: int | None = None) -> torch.Tensor:
        """Rᵀ as dense matrices, ``rotate(x) = x @ Rᵀ``: [n, n], or [heads, n, n] with one
        order per head (``heads``: KV heads or query heads on the axis it multiplies)."""
        if not self.per_head:
            return self.rotate(torch.eye(self.n))
        eye = torch.eye(self.n).expand(heads, self.n, self.n)
        return self.rotate(eye.unsqueeze(0))[0]


@lru_cache(maxsize=None)
def channel_permutation(order: tuple[int, ...], n: int) -> ChannelPermutation:
    """The permutation of a config's ``channel_order`` (n channels; n entries, or n per KV
    head). One shared object per order: caches (and a serving step's requests) that store
    a layer the same way hold the same permutation, as they hold the same rotation."""
    return ChannelPermutation(tuple(tuple(order[i:i + n]) for i in range(0, len(order), n)))
