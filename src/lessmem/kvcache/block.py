"""One immutable block of quantized history: B tokens of one layer's keys and values.

A block is the unit that leaves the full-precision window (tokens are quantized once,
when their block is written). ``QuantizedKVLayer.blocks()`` (and the tiered layer's)
returns the history as these read-only views, for inspection and tests: the first token
``start``, ``n_tokens``, the stored parts by name (``tensors()``: ``k_codes``,
``k_scale``, ``k_zero_point`` if stored, ``v_...``, laid out as the layer's
:class:`~lessmem.formats.kvlayout.KVLayout` says) and ``nbytes``. The tiered cache does
not move ``KVBlock`` objects: its tiers store the same dict of parts
(``tensors()``), serialized by :func:`lessmem.offload.serialize.pack_block` where a tier
needs bytes.

Example:
    >>> import torch
    >>> b = KVBlock(start=4, n_tokens=2, tensors_={"k_codes": torch.zeros(1, 1, 2, 32, dtype=torch.uint8)})
    >>> b.start, b.n_tokens, b.nbytes, list(b.tensors())
    (4, 2, 64, ['k_codes'])
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
