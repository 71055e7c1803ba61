"""``TieredKVLayer``: a quantized layer whose history lives in its cache's tiers.

Like :class:`~lessmem.kvcache.layer.QuantizedKVLayer` it keeps its sinks and window in
full precision on the device; its quantized history is cut into immutable blocks of
``block_tokens`` tokens. The partly filled block (``pending``) stays with the layer; each
full block is sealed into the cache's :class:`~.blocks.BlockStore` and recorded in the
layer's :class:`~.blocks.SealedBlocks`. Attention reads the history through the cache's
:class:`~.reader.HistoryReader`, as a :class:`~lessmem.kernels.attention.SegmentedKV`
over the blocks where they lie (no concatenation).

A layer uses its cache only through the :class:`TierContext` it is built with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...kernels.attention import QuantKV, SegmentedKV
from ..block import KVBlock
from ..config import KVConfig
from ..layer import QuantizedKVLayer, _side, count_part
from .blocks import BlockStore, SealedBlocks, join_parts, tensor_bytes
from .budget import BudgetAccount
from .reader import HistoryReader


@dataclass(frozen=True)
class TierContext:
    """What a tiered layer uses of its cache: where blocks go (``store``), whom it tells
    about its size (``account``), how its history is read (``reader``), the block size
    and the sliding attention window in blocks (None: attend to every block)."""

    store: BlockStore
    account: BudgetAccount
    reader: HistoryReader
    block_tokens: int
    window_blocks: int | None = None


class TieredKVLayer(QuantizedKVLayer):
    """A quantized layer whose history lives in its cache's tiers; see the module doc."""

    def __init__(self, config: KVConfig, layer_idx: int, rotations, fused, tiers: TierContext):
        self.tiers = tiers
        super().__init__(config, layer_idx, rotations, fused)

    def reset(self) -> None:
        super().reset()
        self.sealed = SealedBlocks()
        self.pending: dict[str, torch.Tensor] | None = None  # the partly filled block
        self.n_pending = 0
        self._pending_size = (None, 0)  # (the pending dict measured, its bytes): asked per layer per step
        self._token_size = None
        self._formats = None  # a QuantKV with this layer's formats and no data (the segments share it)
        self.tiers.account.changed()

    # ---- what the cache's objects read --------------------------------------------------
    @property
    def block_keys(self) -> list[str]:
        return self.sealed.keys

    @property
    def block_bytes(self) -> list[int]:
        return self.sealed.nbytes

    def version_tag(self) -> tuple[int, int]:
        """Changes whenever a block is sealed or the partial block grows."""
        return len(self.sealed), self.n_pending

    def hidden_blocks(self) -> int:
        """Sealed blocks outside the attention window (sliding policy), oldest first."""
        w = self.tiers.window_blocks
        return 0 if w is None else max(0, len(self.sealed) - w)

    def visible_keys(self) -> list[str]:
        """The keys of the blocks attention reads."""
        return list(self.sealed.keys[self.hidden_blocks():])

    def token_bytes(self) -> int:
        """Full-precision bytes one more token adds to this layer (keys + values)."""
        if not self.is_initialized:
            return 0
        if self._token_size is None:
            elem = torch.empty(0, dtype=self.store_dtype).element_size()
            self._token_size = 2 * self.batch_size * self.num_heads * self.head_dim * elem
        return self._token_size

    def pending_bytes(self) -> int:
        p = self.pending
        if p is None:
            return 0
        if self._pending_size[0] is not p:  # pending is replaced, never changed in place
            self._pending_size = (p, sum(tensor_bytes(t) for t in p.values()))
        return self._pending_size[1]

    def history_bytes(self) -> int:
        """Quantized bytes of the whole history: sealed blocks and the partial block."""
        return self.sealed.total + self.pending_bytes()

    def visible_history_bytes(self) -> int:
        """Quantized bytes attention reads: the attended blocks and the partial block."""
        return self.sealed.bytes_from(self.hidden_blocks()) + self.pending_bytes()

    def fp_bytes(self) -> int:
        """Bytes of what always stays on the device: sinks, the window's buffer as held (its
        tokens rounded up to ``WINDOW_GRAIN``: ``window_held``), partial block."""
        if not self.is_initialized:
            return 0
        if not self.quantized:
            return tensor_bytes(self.keys) + tensor_bytes(self.values)
        tokens = self.sinks[0].shape[2] + self.window_held()[0].shape[2]
        return tokens * self.token_bytes() + self.pending_bytes()

    # ---- transformers interface ---------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.tiers.account.changed()

    def update(self, key_states, value_states, *args, **kwargs):
        self.tiers.account.forward_tokens = key_states.shape[2]
        return super().update(key_states, value_states, *args, **kwargs)

    def row_parts(self, key_states, value_states):
        return None  # (each update also tells the tier account of the forward's tokens: through update)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        hidden = self.hidden_blocks() * self.tiers.block_tokens
        return self.length + query_length - hidden, hidden

    # ---- writing ------------------------------------------------------------------------
    def _tokens_per_row(self, name: str) -> int:
        side, part = name.split("_", 1)
        return self.layouts[side].tokens_per_row(part)

    def _split(self, parts: dict, tokens: int) -> tuple[dict, dict | None]:
        """``parts`` cut after ``tokens`` tokens: (head, rest or None)."""
        head = {k: t[:, :, : tokens // self._tokens_per_row(k)].clone() for k, t in parts.items()}
        rest = {k: t[:, :, tokens // self._tokens_per_row(k):].clone() for k, t in parts.items()}
        return head, (rest if rest["k_codes"].shape[2] else None)

    def _append_history(self, new: dict[str, torch.Tensor]) -> None:
        self.tiers.account.changed()
        n = new["k_codes"].shape[2]
        if self.pending is None:
            self.pending = {k: t.contiguous() for k, t in new.items()}
        else:
            self.pending = {k: torch.cat([self.pending[k], t], dim=2) for k, t in new.items()}
        self.n_history += n
        self.n_pending += n
        while self.n_pending >= self.tiers.block_tokens and self._seal_first_block():
            pass

    def append_quantized(self, history: dict[str, torch.Tensor], t0: int, t1: int) -> None:
        """Append tokens ``t0..t1`` of an in-memory layer's quantized ``history`` (the
        same config's parts), sealing blocks as they fill."""
        self._append_history({k: t[:, :, t0 // self._tokens_per_row(k):t1 // self._tokens_per_row(k)].clone()
                              for k, t in history.items()})

    def _seal_first_block(self) -> bool:
        """Seal the first ``block_tokens`` pending tokens into a block in the tiers; False
        when no tier takes it: then the tokens stay pending, on the device (the store
        warned once and counts it), and the next append tries again. While the budget
        makes room, the block already counts as sealed."""
        block_tokens = self.tiers.block_tokens
        before = (self.pending, self.n_pending)
        head, self.pending = self._split(self.pending, block_tokens)
        self.n_pending -= block_tokens
        key = self.tiers.store.key(self.layer_idx, len(self.sealed))
        self.sealed.add(key, head)
        self.tiers.account.changed()
        try:
            self.tiers.account.rebalance()
            stored = self.tiers.store.put(key, head) is not None
        except BaseException:  # e.g. an OSError from a tier: undo, nothing is lost, then report it
            stored = False
            raise
        finally:
            if not stored:
                self.sealed.add(key, head, sign=-1)  # nothing was stored: no key is recorded
                self.pending, self.n_pending = before
                self.tiers.account.changed()
        return stored

    def pending_parts(self, pending: dict | None) -> list[dict]:
        """``pending`` (this layer's partial block, as read) as parts of at most
        ``block_tokens`` tokens: one, unless blocks no tier took are waiting in it."""
        if pending is None:
            return []
        block_tokens, parts = self.tiers.block_tokens, []
        while pending is not None and pending["k_codes"].shape[2] > block_tokens:  # (a codes row is a token)
            head, pending = self._split(pending, block_tokens)
            parts.append(head)
        return parts + ([pending] if pending is not None else [])

    # ---- reading ------------------------------------------------------------------------
    def _kv(self, h: dict) -> QuantKV:
        D = self.head_dim
        return QuantKV(_side(self.kspec, h["k_codes"], h["k_scale"], h.get("k_zero_point"), D),
                       _side(self.vspec, h["v_codes"], h["v_scale"], h.get("v_zero_point"), D))

    def read_history(self) -> QuantKV | SegmentedKV | None:
        parts = self.tiers.reader.read(self)
        if not parts:
            return None
        # (block_tokens is a multiple of block_size, itself a multiple of both token groups)
        if len(parts) == 1 or parts[0]["k_codes"].device.type != "cpu":
            return self._kv(join_parts(parts))
        # the blocks as they lie (device tier) or arrived (lower tiers): read in place
        if self._formats is None:  # the formats (bits, groups, level table) of this layer, no data
            kv, e = self._kv(parts[0]), torch.empty(0, dtype=torch.uint8)

            def fmt(x):
                return replace(x, codes=e, scale=e, zero_point=None if x.zero_point is None else e)
            self._formats = QuantKV(fmt(kv.keys), fmt(kv.values))
        f = self._formats
        kz, vz = f.keys.zero_point is not None, f.values.zero_point is not None
        return SegmentedKV(f.keys, f.values,
                           tuple((p["k_codes"], p["k_scale"], p["k_zero_point"] if kz else None) for p in parts),
                           tuple((p["v_codes"], p["v_scale"], p["v_zero_point"] if vz else None) for p in parts),
                           self.tiers.block_tokens)

    def blocks(self) -> list[KVBlock]:
        block_tokens = self.tiers.block_tokens
        return [KVBlock(self.config.sinks + i * block_tokens, block_tokens, self.tiers.store.fetch(k))
                for i, k in enumerate(self.sealed.keys)]

    def memory(self) -> dict[str, int]:
        m = super().memory()  # sinks, window, tokens (self.history stays None); history below
        if not self.quantized or not self.is_initialized:
            return m
        for name, b in self.sealed.part_bytes.items():
            count_part(m, name, b)
        for name, t in (self.pending or {}).items():
            count_part(m, name, tensor_bytes(t))
        m["quant_elements"] = self.batch_size * self.num_heads * self.n_history * self.head_dim
        return m

    def _map(self, fn) -> None:
        if self.sealed.keys or self.pending is not None:
            raise ValueError("a tiered cache cannot reorder or select batch rows of offloaded "
                             "history; allowed: batch operations before any block is written")
        super()._map(fn)

    # ---- whole-state changes (conversion, prefix restore) ---------------------------------
    def start_like(self, probe: torch.Tensor) -> None:
        """Initialize empty, with ``probe``'s batch, heads, head_dim, dtype and device."""
        self.lazy_initialization(probe, probe)

    def load(self, *, length: int, sinks=None, window=None, sealed: tuple | None = None,
             n_history: int = 0, pending: dict | None = None) -> None:
        """Set the state of an initialized layer: ``sinks``/``window`` (key, value) pairs
        (None: keep), ``sealed`` = (keys, bytes per block, bytes per part) of blocks the
        tiers hold, ``n_history`` quantized tokens, of which those past the sealed
        blocks are ``pending``."""
        if sinks is not None:
            self.sinks = (sinks[0].to(self.device), sinks[1].to(self.device))
        if window is not None:
            self.window = (window[0].to(self.device), window[1].to(self.device))
        if sealed is not None:
            self.sealed.load(*sealed)
        self.n_history = n_history
        self.n_pending = n_history - len(self.sealed) * self.tiers.block_tokens
        self.pending = {k: t.to(self.device) for k, t in pending.items()} if pending else None
        self.length = length
        self.tiers.account.changed()

    def rekey(self, idx: int, key: str) -> None:
        """Block ``idx`` is now stored under ``key`` (a session key became a content key)."""
        self.sealed.keys[idx] = key
