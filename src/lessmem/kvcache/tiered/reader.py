"""How a tiered layer's history reaches attention, one read per layer per forward.

:class:`HistoryReader` is the one read path: it takes the gather the prefetcher
started for this layer (or reads the blocks now, on the decoding thread's cores),
rebalances the device budget, counts the blocks read from lower tiers as staged beside
the device tier, starts reading ahead for the next layer, and samples the device peak.
"""

from __future__ import annotations

import torch

from .blocks import BlockStore, to_device
from .budget import BudgetAccount
from .prefetch import Prefetcher
from .staging import CudaStager, ready


class HistoryReader:
    """The read path of one cache's tiered layers (see the module doc)."""

    def __init__(self, store: BlockStore, account: BudgetAccount, prefetcher: Prefetcher):
        self.store, self.account, self.prefetcher = store, account, prefetcher
        self.layers: list = []  # the tiered layers, in order (the next one is read ahead)
        self.stager: CudaStager | None = None  # made at the first read of a CUDA layer

    def attach(self, tiered_layers: list) -> None:
        self.layers = list(tiered_layers)

    def gather(self, layer, keys: list[str], pending, threads: int = 1):
        """``layer``'s blocks of ``keys`` in order, then ``pending`` (its partial block, if
        any), on the layer's device (``threads``: cores the reads may use). On CUDA the
        copies up from lower tiers are issued on a side stream (``staging.CudaStager``) and
        a ``Staged`` is returned: ``read`` makes the compute stream wait for it."""
        parts = self.store.gather(keys, threads) + layer.pending_parts(pending)
        if layer.device.type == "cuda":
            if self.stager is None:
                self.stager = CudaStager()
            return self.stager.stage(parts, layer.device)
        return to_device(parts, layer.device)

    def read(self, layer) -> list[dict]:
        """The parts attention reads for ``layer``: its attended blocks and partial block."""
        tag = layer.version_tag()
        hist = self.prefetcher.take(layer.layer_idx, tag)  # gathered in the background ("gather")
        self.account.staged = 0  # the previous layer's gathered history is no longer used
        if hist is None:  # on the decoding thread, between the model's parallel ops: all its cores
            hist = self.gather(layer, layer.visible_keys(), layer.pending, torch.get_num_threads())
        hist = ready(hist)  # CUDA: the compute stream waits for the copies (no host sync)
        resident = self.account.resident()
        self.account.rebalance(resident)
        # held beside the device tier: the blocks read from lower tiers, and any block the
        # rebalance just demoted that this read still references
        first = layer.hidden_blocks()
        keys, sizes = layer.block_keys[first:], layer.block_bytes[first:]
        self.account.staged = sum(b for b, on in zip(sizes, self.store.on_device(keys), strict=True) if not on)
        mode = self.prefetcher.mode if len(self.layers) > 1 else None
        if mode == "gather":
            nxt = self.layers[(self.layers.index(layer) + 1) % len(self.layers)]
            if nxt.block_keys:
                self.prefetcher.start(nxt.layer_idx, nxt.version_tag(), nxt.history_bytes(),
                                      self.gather, nxt, nxt.visible_keys(), nxt.pending)
        elif mode == "hint" and layer is self.layers[0]:  # once a step: every layer's blocks
            self.prefetcher.hint([k for each in self.layers for k in each.visible_keys()])
        self.account.record_peak(resident)
        return hist
