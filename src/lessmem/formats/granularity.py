"""Granularity: which elements share one scale.

Every granularity maps a tensor to a 2-D *grouped view* ``[G, E]`` (G groups of E
elements each, one scale per group) and back. Codes are stored in that grouped
layout; ``ungroup`` restores the original layout.

- ``PerTensor()``        one scale for everything                       G = 1
- ``PerChannel(axis)``   one scale per index of ``axis`` (or a tuple of kept axes);
                         a weight ``[out, in]`` per output channel is ``PerChannel(0)``;
                         per-head on ``[B, H, T, D]`` is ``PerChannel((0, 1))``.
- ``PerToken()``         one scale per vector along the last axis (per-token K/V rows)
- ``PerGroup(size, axis=-1)``  contiguous groups of ``size`` along ``axis``;
                         keys per-channel in groups of G tokens on ``[B, H, T, D]`` is
                         ``PerGroup(G, axis=-2)``.
- ``SuperBlock(size, sub, axis=-1)``  blocks of ``size`` split into sub-blocks of
                         ``sub``; each sub-block scale is itself quantized against one
                         scale per super-block (the GGUF K-quant idea).

Example:
    >>> import torch
    >>> from lessmem.formats import PerGroup
    >>> g = PerGroup(32)
    >>> view, meta = g.group(torch.zeros(4, 128))
    >>> tuple(view.shape)
    (16, 32)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for a tensor with {ndim} dimensions")
    return axis % ndim


def _blocks_along(shape, axis: int, size: int, group: int, what: str):
    """Layout for contiguous blocks of ``size`` along ``axis``, viewed as groups of ``group``:
    move ``axis`` last, then ``[numel / group, group]``."""
    nd = len(shape)
    ax = _norm_axis(axis, nd)
    n = shape[ax]
    if n % size:
        raise ValueError(
            f"{what} {size} does not divide axis {axis} of length {n} "
            f"(shape {tuple(shape)}); choose a size that divides {n} or pad the tensor"
        )
    perm = tuple([i for i in range(nd) if i != ax] + [ax])
    numel = 1
    for s in shape:
        numel *= s
    return perm, numel // group, group


@dataclass(frozen=True)
class GroupMeta:
    """What ``ungroup`` needs to undo ``group``."""

    shape: tuple[int, ...]  # original shape
    perm: tuple[int, ...]  # permutation applied before the reshape
    permuted_shape: tuple[int, ...]


class Granularity(ABC):
    """Base class. Subclasses implement ``_layout(shape)`` -> (perm, n_groups, group_elems)."""

    @abstractmethod
    def _layout(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
        """Permutation to apply, number of groups, elements per group."""

    def group(self, x: torch.Tensor) -> tuple[torch.Tensor, GroupMeta]:
        perm, g, e = self._layout(tuple(x.shape))
        xp = x.permute(perm) if perm != tuple(range(x.ndim)) else x
        meta = GroupMeta(tuple(x.shape), perm, tuple(xp.shape))
        return xp.reshape(g, e), meta

    @staticmethod
    def ungroup(v: torch.Tensor, meta: GroupMeta) -> torch.Tensor:
        xp = v.reshape(meta.permuted_shape)
        if meta.perm == tuple(range(len(meta.perm))):
            return xp
        inv = [0] * len(meta.perm)
        for i, p in enumerate(meta.perm):
            inv[p] = i
        return xp.permute(inv)

    def n_groups(self, shape) -> int:
        return self._layout(tuple(shape))[1]

    def to_dict(self) -> dict:
        d = {"kind": type(self).__name__}
        d.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()})
        return d

    @staticmethod
    def from_dict(d: dict) -> Granularity:
        kinds = {c.__name__: c for c in (PerTensor, PerChannel, PerToken, PerGroup, SuperBlock)}
        d = dict(d)
        kind = d.pop("kind", None)
        if kind not in kinds:
            raise ValueError(f"granularity kind={kind!r}; allowed: {', '.join(kinds)}")
        if isinstance(d.get("axis"), list):
            d["axis"] = tuple(d["axis"])
        return kinds[kind](**d)


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One scale for the whole tensor."""

    def _layout(self, shape):
        n = 1
        for s in shape:
            n *= s
        return tuple(range(len(shape))), 1, n


@dataclass(frozen=True)
class PerChannel(Granularity):
    """One scale per index of the kept ``axis`` (an int, or a tuple of kept axes)."""

    axis: int | tuple[int, ...] = 0

    def __post_init__(self):
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            raise ValueError(f"PerChannel axis={self.axis!r} must be an int or a tuple of ints")

    def _layout(self, shape):
        nd = len(shape)
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        kept = sorted({_norm_axis(a, nd) for a in axes})
        rest = [i for i in range(nd) if i not in kept]
        g = 1
        for a in kept:
            g *= shape[a]
        e = 1
        for a in rest:
            e *= shape[a]
        return tuple(kept + rest), g, e


@dataclass(frozen=True)
class PerToken(Granularity):
    """One scale per vector along the last axis (a K/V row, an activation token)."""

    def _layout(self, shape):
        if not shape:
            raise ValueError("PerToken needs a tensor with at least one dimension")
        e = shape[-1]
        g = 1
        for s in shape[:-1]:
            g *= s
        return tuple(range(len(shape))), g, e


@dataclass(frozen=True)
class PerGroup(Granularity):
    """Contiguous groups of ``size`` elements along ``axis``, one scale each."""

    size: int = 128
    axis: int = -1

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"group size={self.size!r} must be a positive integer")

    def _layout(self, shape):
        return _blocks_along(shape, self.axis, self.size, self.size, "group size")


@dataclass(frozen=True)
class SuperBlock(Granularity):
    """Super-blocks of ``size`` along ``axis`` made of sub-blocks of ``sub`` elements.

    The grouped view is per *sub-block* (``[G_sub, sub]``); the quantizer then stores
    sub-block scales as ``sub_scale_bits``-bit codes against one float scale per
    super-block (as GGUF's K-quants do).
    """

    size: int = 256
    sub: int = 32
    axis: int = -1
    sub_scale_bits: int = 6

    def __post_init__(self):
        for name in ("size", "sub"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SuperBlock {name}={v!r} must be a positive integer")
        if self.size % self.sub:
            raise ValueError(f"SuperBlock sub={self.sub} must divide size={self.size}")
        if self.sub_scale_bits not in (4, 6, 8):
            raise ValueError(f"SuperBlock sub_scale_bits={self.sub_scale_bits}; allowed: 4, 6, 8")

    @property
    def subs_per_block(self) -> int:
        return self.size // self.sub

    def _layout(self, shape):
        return _blocks_along(shape, self.axis, self.size, self.sub, "super-block size")
