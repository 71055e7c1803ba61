"""One immutable block of quantized history: B tokens of one layer's keys and values.

A block is the unit that leaves the full-precision window (tokens are quantized once,
when their block is written) and the unit a tiered cache moves between memory, disk
and remote stores. It is a small self-contained object: a dict of tensors
(``tensors()``), ``nbytes``, and ``to_bytes()/from_bytes()`` (safetensors).

Example:
    >>> import torch
    >>> b = KVBlock(start=4, n_tokens=2, tensors_={"k_codes": torch.zeros(1, 1, 2, 32, dtype=torch.uint8)})
    >>> b2 = KVBlock.from_bytes(b.to_bytes())
    >>> b2.start, b2.n_tokens, b2.nbytes
    (4, 2, 64)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

# names of the tensors a block may hold (scale/zero point rows are per token group)


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
        from safetensors.torch import save

        meta = {"start": str(self.start), "n_tokens": str(self.n_tokens)}
        return save({k: v.contiguous() for k, v in self.tensors_.items()}, metadata=meta)

    @staticmethod
    def from_bytes(blob: bytes) -> KVBlock:
        from safetensors.torch import load

        tensors = load(blob)
        n = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8:8 + n]).get("__metadata__", {})
        return KVBlock(int(meta["start"]), int(meta["n_tokens"]), tensors)
