"""One immutable block of quantized history: B tokens of one layer's keys and values.

A block is the unit that leaves the full-precision window (tokens are quantized once,
when their block is written) and the unit a tiered cache moves between memory, disk
and remote stores. It is a small self-contained object: a dict of tensors
(``tensors()``), ``nbytes``, and ``to_bytes()/from_bytes()`` — the same checksummed
format the offload tiers store (:mod:`lessmem.offload.serialize`).

Example:
    >>> import torch
    >>> b = KVBlock(start=4, n_tokens=2, tensors_={"k_codes": torch.zeros(1, 1, 2, 32, dtype=torch.uint8)})
    >>> b2 = KVBlock.from_bytes(b.to_bytes())
    >>> b2.start, b2.n_tokens, b2.nbytes
    (4, 2, 64)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVBlock:
    """Tokens ``[start, start + n_tokens)`` of one layer, quantized (see module doc)."""

    start: int
    n_tokens: int
    tensors_: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors_)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors_.values())

    def to_bytes(self) -> bytes:
        from ..offload.serialize import pack_block

        return pack_block(self.tensors_, meta={"start": self.start, "n_tokens": self.n_tokens})

    @staticmethod
    def from_bytes(blob: bytes) -> KVBlock:
        """Raises ``CorruptBlockError`` (a ValueError) when the bytes do not verify."""
        from ..offload.serialize import unpack_block

        tensors, meta = unpack_block(blob)
        return KVBlock(int(meta["start"]), int(meta["n_tokens"]), tensors)
