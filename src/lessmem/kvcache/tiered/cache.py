"""``TieredKVCache``: the quantized KV cache with its history spread over tiers.

The cache is a :class:`~lessmem.kvcache.KVCache` whose quantized layers are
:class:`~.layer.TieredKVLayer` objects, plus the objects they share:

- :class:`~.blocks.BlockStore`: the cache's tiers (device tier first) and block keys;
- :class:`~.budget.BudgetAccount` on a :class:`~.budget.DeviceBudget` (which several
  caches may share): what the cache holds on the device, and the device tier's size;
- :class:`~.prefetch.Prefetcher`: the background thread and the reads in flight;
- :class:`~.reader.HistoryReader`: the one read path of the layers' histories;
- :class:`~.prefix.PrefixStore`: the saved state after a prompt (prefix reuse).

See :mod:`lessmem.kvcache.tiered` for the policy and an example.
"""

from __future__ import annotations

import torch

from ...base.placement import check_lower_tiers
from ...offload import Tier, build_tiers, check_block_tokens, parse_offload_spec
from ..cache import ATTENTION_MODES, KVCache, cache_kwargs, check_model_config  # noqa: F401  (cache_kwargs re-exported)
from ..config import KVConfig
from ..layer import QuantizedKVLayer
from ..presets import resolve
from . import persist
from .blocks import BlockStore
from .budget import DeviceBudget
from .layer import TierContext, TieredKVLayer
from .prefetch import Prefetcher, check_prefetch
from .prefix import PrefixStore
from .reader import HistoryReader
from .recovery import Recovery, check_model


def _lower_tiers(tiers) -> list[Tier]:
    specs = parse_offload_spec(tiers) if isinstance(tiers, str) else tiers
    check_lower_tiers(specs if isinstance(specs, list) else [], what="tiers")
    return build_tiers("host" if specs is None else specs)


def _check_model_id(model_id) -> None:
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ValueError(f"model_id={model_id!r}; allowed: None (the weights' fingerprint, see "
                         "lessmem.kvcache.identity) or a non-empty string naming these exact weights")


def _check_window(attention_window, block_tokens: int, sinks: int) -> None:
    if attention_window is None:
        return
    if isinstance(attention_window, bool) or not isinstance(attention_window, int) \
            or attention_window < block_tokens or attention_window % block_tokens:
        raise ValueError(f"attention_window={attention_window!r}; allowed: None or a positive "
                         f"multiple of block_tokens {block_tokens}")
    if sinks:
        raise ValueError(f"attention_window needs a config with sinks=0 (got sinks={sinks}); "
                         "allowed: e.g. config.replace(sinks=0)")


class TieredKVCache(KVCache):
    """Quantized KV cache over tiers; see :mod:`lessmem.kvcache.tiered`.

    ``tiers``: lower tiers (fastest first) as a spec string (``"host,disk:/path"``), a
    list of :class:`~lessmem.offload.Tier` or :class:`~lessmem.offload.TierSpec`.
    ``device_budget``: bytes (or ``"64MiB"``) the cache may hold on the device, None =
    unbounded, or a :class:`~.budget.DeviceBudget` shared with other caches.
    ``block_tokens``: tokens per stored block (multiple of the config's ``block_size``).
    ``write_policy``: ``"write-back"`` or ``"write-through"``. ``model``: the model the
    cache serves (its weights' fingerprint names stored state; lost blocks can be
    recomputed, :mod:`~.recovery`); ``prefill(model, ...)`` binds it too. ``model_id``:
    a string naming these exact weights instead of the fingerprint (trusted as given).
    With neither, nothing the cache stores is shared (session keys; ``save_prefix``
    refuses). ``attention_window``: None
    (attend to everything) or the sliding-window policy: attend to the most recent
    blocks covering this many tokens (a multiple of ``block_tokens``; needs ``sinks=0``)
    plus the window; older blocks stay in the tiers for prefix reuse. ``prefetch``: True
    (auto), "gather", "hint" or False (:mod:`~lessmem.kvcache.tiered.prefetch`).
    """

    def __init__(self, model_config, config: str | KVConfig = "int4", tiers=None, device_budget=None,
                 block_tokens: int = 256, prefetch: bool | str = True, write_policy: str = "write-back",
                 attention: str = "auto", model_id: str | None = None,
                 attention_window: int | None = None, model=None):
        check_model_config(model_config)  # a model or None: TypeError naming the fix
        _check_model_id(model_id)
        kv_config = resolve(config)  # every argument is checked before any tier is opened
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}; allowed: {', '.join(ATTENTION_MODES)}")
        check_block_tokens(block_tokens, kv_config.block_size)
        _check_window(attention_window, block_tokens, kv_config.sinks)
        budget = device_budget if isinstance(device_budget, DeviceBudget) else DeviceBudget(device_budget)
        check_prefetch(prefetch)
        check_model(model, model_config)
        self.block_tokens, self.attention_window = block_tokens, attention_window
        self.recovery = Recovery(self, model_id)
        self.store = BlockStore(_lower_tiers(tiers), write_policy, model_id,
                                {**kv_config.to_dict(), "block_tokens": block_tokens}, block_tokens,
                                kv_config.sinks)
        self.prefetcher = Prefetcher(prefetch, self.store.lower, self.store.device_tier.device.type)
        self.budget = budget
        self.account = budget.open(self.store.device_tier, self.prefetcher.enabled,
                                   in_flight=self.prefetcher.in_flight_bytes)
        self.reader = HistoryReader(self.store, self.account, self.prefetcher)
        self.prefixes = PrefixStore(self.store, kv_config.sinks, block_tokens)
        self._context = TierContext(self.store, self.account, self.reader, block_tokens,
                                    None if attention_window is None else attention_window // block_tokens)
        super().__init__(model_config, kv_config, attention)
        self.refresh_layers()
        if model is not None:
            self.recovery.bind(model)

    def _new_layer(self, layer_idx: int) -> TieredKVLayer:
        return TieredKVLayer(self.kv_config, layer_idx, self.rotations, self._fused, self._context)

    def _new_sliding_layer(self, layer_idx: int, sliding_window: int) -> TieredKVLayer:
        """Sliding layers keep every block too: the tiers hold the history (the mask hides
        what slid out; ``attention_window`` is the tiered cache's own sliding policy)."""
        return self._new_layer(layer_idx)

    def refresh_layers(self) -> None:
        """Tell the account and the reader which layers there are (after replacing any)."""
        self.tiered = [layer for layer in self.layers if isinstance(layer, TieredKVLayer) and layer.quantized]
        self.account.attach([layer for layer in self.layers if isinstance(layer, QuantizedKVLayer)], self.tiered)
        self.reader.attach(self.tiered)

    # ---- the parts, by their old names ---------------------------------------------------
    @property
    def stack(self):
        return self.store.stack

    @property
    def lower(self) -> list[Tier]:
        return self.store.lower

    @property
    def device_tier(self):
        return self.store.device_tier

    @property
    def session(self) -> str:
        return self.store.session

    @property
    def prefetch(self) -> str | None:
        """What reading ahead does now: "gather", "hint" or None."""
        return self.prefetcher.mode

    @property
    def device_budget(self) -> int | None:
        return self.budget.limit

    @property
    def device_peak(self) -> int:
        return self.account.peak

    @property
    def over_budget(self) -> int:
        """Reads at which even an empty device tier could not meet the budget."""
        return self.account.over_budget

    @property
    def prefill_skipped(self) -> int:
        return self.prefixes.skipped

    @property
    def prefix_tokens_reused(self) -> int:
        return self.prefixes.tokens_reused

    def fp_bytes(self) -> int:
        """Bytes the layers hold on the device whatever the budget (sinks, windows, partial blocks)."""
        return self.account.resident()

    def device_bytes(self) -> int:
        """Bytes held on the device now: device tier, resident, staged, in flight."""
        return self.account.device_bytes()

    def set_device_budget(self, device_budget) -> None:
        """Change the device budget (bytes or ``"64MiB"``; None = unbounded) and demote to fit."""
        self.budget.set_limit(device_budget)
        self.account.rebalance()

    def set_tokens(self, token_ids) -> None:
        """Declare the token ids the cache holds/will hold (batch 1): blocks fully inside
        them are keyed by content (shareable); other blocks get session keys."""
        ids = torch.as_tensor(token_ids)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"token ids of batch {ids.shape[0]}; allowed: batch 1 for prefix keys")
            ids = ids[0]
        ids = ids.reshape(-1).tolist()
        self.recovery.declare(ids)
        self.store.set_tokens(ids)

    # ---- identity and recovery (lessmem.kvcache.tiered.recovery) -------------------------
    @property
    def model_id(self) -> str | None:
        """What names this cache's stored state: the bound model's fingerprint, the
        ``model_id`` given, or None (unbound: nothing is shared)."""
        return self.store.model_id

    def bind_model(self, model) -> None:
        """Serve ``model`` (see the ``model`` argument); ValueError when the cache holds
        another model's state."""
        self.recovery.bind(model)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """``KVCache.update``; a block no tier returns any more is recomputed when the model
        and the token ids are known (:mod:`~.recovery`)."""
        return self.recovery.update(super().update, key_states, value_states, layer_idx, *args, **kwargs)

    # ---- conversion (lessmem.kvcache.tiered.convert) ----------------------------------
    @classmethod
    def from_cache(cls, src: KVCache, **kwargs) -> TieredKVCache:
        """A tiered copy of a filled in-memory :class:`KVCache` (same config and model
        config; ``kwargs`` as for the constructor): its sinks and windows are copied,
        its quantized history is cut into blocks and placed in the tiers."""
        from .convert import fill_from

        new = cls(src.model_config, src.kv_config, attention=src.attention, **kwargs)
        fill_from(new, src)
        return new

    def to_kvcache(self) -> KVCache:
        """An in-memory :class:`KVCache` holding the same state (every block gathered)."""
        from .convert import in_memory_copy

        return in_memory_copy(self)

    # ---- prefix persistence (lessmem.kvcache.tiered.persist) --------------------------
    def save_prefix(self, token_ids, logits: torch.Tensor | None = None) -> str:
        """Persist the state after ``token_ids`` (:mod:`~.prefix`); returns the record key."""
        return persist.save_prefix(self, token_ids, logits)

    def restore_blocks(self, token_ids, dtype=None, device=None, model=None) -> int:
        """Load the longest run of leading blocks of ``token_ids`` that the lower tiers
        hold for every layer (saved by any cache with the same model id and config),
        leaving at least one token to compute; returns the tokens restored (0: none, also
        for a cache that does not know its model). Each block is read and verified first:
        the restore stops before the first missing or corrupt one. ``model`` binds it.

        The restored tokens are quantized history, exactly as stored; the caller feeds the
        rest of the prompt. The result is not bit-identical to a full prefill: there, the
        later prompt tokens attended to the last restored ones while those were still in
        the full-precision window (a difference of the same kind as the cache's own)."""
        return persist.restore_blocks(self, token_ids, dtype, device, model)

    def restore_prefix(self, token_ids, model=None) -> torch.Tensor | None:
        """Load the state saved for exactly ``token_ids``; returns its logits (or an empty
        tensor if none were saved), or None when no complete and valid record is found
        (every block is read and verified first) or the cache does not know its model
        (``model`` binds it)."""
        return persist.restore_prefix(self, token_ids, model)

    def prefill(self, model, input_ids: torch.Tensor, chunk: int | None = None, save: bool = True,
                reuse_prefix: bool = True):
        """Logits [B, vocab] after ``input_ids``: restored from the tiers when this exact
        prompt was saved before (prefill skipped); else, with ``reuse_prefix``, the leading
        blocks the tiers hold for this prompt's prefix are loaded (:meth:`restore_blocks`)
        and only the rest is computed, in chunks of ``chunk`` tokens (default
        ``block_tokens``); saved when ``save`` (a save no tier can hold is warned about,
        the logits are returned all the same)."""
        return persist.prefill(self, model, input_ids, chunk, save, reuse_prefix)

    # ---- reporting / lifecycle -----------------------------------------------------------
    def memory(self) -> dict:
        """``KVCache.memory()`` plus ``device_bytes``, ``device_peak`` and ``tiers`` (bytes per tier)."""
        out = super().memory()
        out.update(device_bytes=self.device_bytes(), device_peak=self.device_peak,
                   device_budget=self.device_budget, tiers=self.store.stack.placement())
        return out

    def offload_stats(self) -> dict:
        """Per-tier hits, misses, bytes moved, GB/s; prefetch on-time/late counts; prefix
        reuse; ``over_budget`` (reads over the device budget), ``needed_budget`` (the most
        this cache needed on the device besides its device tier) and ``refused_blocks``
        (seals no tier took: their tokens stayed on the device); ``recoveries`` and
        ``tokens_recomputed`` (blocks lost from the tiers, recomputed: :mod:`~.recovery`)."""
        out = self.store.stack.stats()
        out.update(self.recovery.stats())
        out["prefetch"] = self.prefetcher.stats.to_dict()
        out["prefill_skipped"] = self.prefill_skipped
        out["prefix_tokens_reused"] = self.prefix_tokens_reused
        out["over_budget"] = self.over_budget
        out["needed_budget"] = int(self.account.needed)
        out["refused_blocks"] = self.store.refused
        return out

    def reset(self) -> None:
        self.prefetcher.drain()
        self.account.staged = 0
        super().reset()

    def close(self, keep_session: bool = False) -> None:
        """Stop the prefetcher, drop this session's (non-shareable) blocks, close the tiers."""
        self.prefetcher.close()
        self.account.close()
        self.recovery.unbind()  # the model's forward hook goes
        self.store.close(keep_session, [k for layer in self.tiered for k in layer.block_keys])

    def __repr__(self) -> str:
        return (f"TieredKVCache(layers={len(self.layers)}, config={self.kv_config}, "
                f"tiers={[t.name for t in self.store.stack.tiers]}, device_budget={self.device_budget})")
