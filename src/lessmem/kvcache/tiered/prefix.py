"""Prefix reuse: a prompt's state saved in the lower tiers, and loaded instead of computed.

``save`` persists the state after a prompt: every block to every lower tier (session
keys become content keys, so other caches find them) plus one *state record* with each
layer's sinks, window, partial block and the last logits. ``restore`` loads that record
into an empty cache. A prompt that only *starts* like a stored one gets the blocks of
the shared prefix (``restore_blocks``: the longest run of leading blocks every layer
has, plus the exact sinks from a *sinks record*) and computes the rest.

A save succeeds when every block and the state record are held by at least one lower
tier (a small host tier may not take a state record; a full disk may not take blocks
the host already holds). Only when no lower tier holds one of them does it raise
:class:`~lessmem.offload.TierFullError`; the cache's blocks stay readable either way.
"""

from __future__ import annotations

import torch

from ...offload import block_nbytes
from .blocks import BlockStore, tensor_bytes


class PrefixStore:
    """Saves and restores a cache's state after a prompt; see the module doc."""

    def __init__(self, store: BlockStore, sinks: int, block_tokens: int):
        self.store, self.sinks, self.block_tokens = store, sinks, block_tokens
        self.skipped = 0  # prefills replaced by a restored state
        self.tokens_reused = 0  # prompt tokens loaded from the tiers instead of computed

    def state_key(self, ids: list[int]) -> str:
        return self.store.record_key("state", ids)

    def sinks_key(self, ids: list[int]) -> str:
        return self.store.record_key("sinks", ids)

    # ---- saving ---------------------------------------------------------------------------
    def save(self, layers: list, ids: list[int], logits: torch.Tensor | None) -> str:
        """Persist the state of ``layers`` after ``ids`` (declared to the store already);
        returns the state record's key."""
        rec: dict[str, torch.Tensor] = {"length": torch.tensor([len(ids)])}
        if logits is not None:
            rec["logits"] = logits.detach().float().cpu()
        for layer in layers:
            for idx, key in enumerate(layer.block_keys):
                want = self.store.key(layer.layer_idx, idx)
                self.store.save_below(want, lambda k=key: self.store.fetch(k))  # stored ones are not read
                if key != want:  # a session key becomes the shareable content key
                    self.store.delete(key)
                    layer.rekey(idx, want)
            rec.update(self._layer_record(layer))
        key = self.state_key(ids)
        self.store.save_below(key, rec)
        if self.sinks and len(ids) >= self.sinks:  # for prompts that share only a prefix with this one
            srec = {k: v for k, v in rec.items() if ".sinks_" in k or k.endswith(".probe")}
            self.store.save_below(self.sinks_key(ids[:self.sinks]), srec)
        return key

    @staticmethod
    def _layer_record(layer) -> dict[str, torch.Tensor]:
        i = layer.layer_idx
        rec = {f"L{i}.probe": torch.empty(layer.batch_size, layer.num_heads, 0, layer.head_dim, dtype=layer.dtype),
               f"L{i}.block_bytes": torch.tensor(layer.block_bytes, dtype=torch.int64),
               f"L{i}.n_history": torch.tensor([layer.n_history])}
        rec[f"L{i}.sinks_k"], rec[f"L{i}.sinks_v"] = layer.sinks
        rec[f"L{i}.window_k"], rec[f"L{i}.window_v"] = layer.window
        for k, t in (layer.pending or {}).items():
            rec[f"L{i}.p.{k}"] = t
        return rec

    # ---- restoring ------------------------------------------------------------------------
    def _part_bytes(self, keys: list[str]) -> dict[str, int]:
        if not keys:
            return {}
        first = self.store.fetch(keys[0])  # every block of a layer has the same part sizes
        return {k: tensor_bytes(t) * len(keys) for k, t in first.items()}

    def restore(self, layers: list, ids: list[int]) -> torch.Tensor | None:
        """Load the state saved for exactly ``ids`` into empty ``layers``; its logits (an
        empty tensor if none were saved), or None (nothing changed) when no complete
        record is found."""
        rec = self.store.find_below(self.state_key(ids))
        if rec is None:
            return None
        keys = {layer.layer_idx: [self.store.key(layer.layer_idx, b)
                               for b in range(len(rec[f"L{layer.layer_idx}.block_bytes"]))] for layer in layers}
        if not all(self.store.find_below(k) is not None for ks in keys.values() for k in ks):
            return None  # read and verified before any layer changes (a corrupt block is a miss)
        for layer in layers:
            i, ks = layer.layer_idx, keys[layer.layer_idx]
            layer.start_like(rec[f"L{i}.probe"])
            pending = {k.split(".p.", 1)[1]: t for k, t in rec.items() if k.startswith(f"L{i}.p.")}
            layer.load(length=int(rec["length"][0]), sinks=(rec[f"L{i}.sinks_k"], rec[f"L{i}.sinks_v"]),
                    window=(rec[f"L{i}.window_k"], rec[f"L{i}.window_v"]),
                    sealed=(ks, rec[f"L{i}.block_bytes"].tolist(), self._part_bytes(ks)),
                    n_history=int(rec[f"L{i}.n_history"][0]), pending=pending)
        self.skipped += 1
        self.tokens_reused += len(ids)
        return rec.get("logits", torch.empty(0))

    def restore_blocks(self, layers: list, ids: list[int], head_dim: int, dtype, device=None) -> int:
        """Load into empty ``layers`` the longest run of leading blocks of ``ids`` that the
        lower tiers hold for every layer, leaving at least one token to compute; returns
        the tokens restored (0: nothing found, nothing changed). Without sinks the layers
        start with ``head_dim``, ``dtype`` and the stored batch and heads; on ``device``."""
        s, block_tokens = self.sinks, self.block_tokens
        srec = None
        if s:
            srec = self.store.find_below(self.sinks_key(ids[:s])) if len(ids) > s else None
            if srec is None:
                return 0
        n = min(self.store.content_blocks, (len(ids) - s - 1) // block_tokens)
        k = 0
        # read and verified, not only present: the restore stops before a missing or corrupt block
        while k < n and all(self.store.find_below(self.store.key(layer.layer_idx, k)) is not None
                            for layer in layers):
            k += 1
        if not k:
            return 0
        for layer in layers:
            i = layer.layer_idx
            keys = [self.store.key(i, b) for b in range(k)]
            first = self.store.fetch(keys[0])
            if srec is not None:
                probe = srec[f"L{i}.probe"]
            else:
                codes = first["k_codes"]
                probe = torch.empty(codes.shape[0], codes.shape[1], 0, head_dim, dtype=dtype)
            layer.start_like(probe if device is None else probe.to(device))
            sinks = (srec[f"L{i}.sinks_k"], srec[f"L{i}.sinks_v"]) if srec is not None else None
            parts = {name: tensor_bytes(t) * k for name, t in first.items()}
            layer.load(length=s + k * block_tokens, sinks=sinks, sealed=(keys, [block_nbytes(first)] * k, parts),
                    n_history=k * block_tokens)
        self.tokens_reused += s + k * block_tokens
        return s + k * block_tokens
