"""``TieredKVCache``: the quantized KV cache with its history spread over tiers.

Each quantized layer keeps its sinks and window in full precision on the device (as
:class:`~lessmem.kvcache.layer.QuantizedKVLayer` does) and cuts its quantized history
into immutable blocks of ``block_tokens`` tokens (a multiple of ``KVConfig.block_size``).
A sealed block goes into a :class:`~lessmem.offload.TierStack` whose first tier is the
*device* tier (a byte budget) and whose lower tiers are what ``tiers`` names (host RAM,
a disk directory, Redis). Policy: the sinks, the window, the partly filled block and the
most recent sealed blocks stay on the device within ``device_budget``; older blocks are
demoted down the tiers (write-back, or written through to every tier) and fetched back
for attention. With ``attention_window=W`` (sliding policy) attention only reads the
blocks covering the last W tokens plus the window; older blocks stay in the tiers for
prefix reuse across requests and restarts, and decoding never reads them.

Attention reads the history through ``read_history()`` (the layer's one read point):
the blocks of the layer are collected in order from wherever they live — device-tier
blocks by reference, lower-tier blocks as the copies just read — and handed to the fused
kernel as a :class:`~lessmem.kernels.attention.SegmentedKV`, which walks them in place
(no concatenation); it computes exactly what it computes over one contiguous history,
so the logits equal an in-memory cache's bit for bit.
Prefetch (:mod:`~lessmem.kvcache.tiered.prefetch`): ``"gather"`` reads the next
layer's blocks on a background thread while this layer computes; ``"hint"`` asks the
disk tier's native thread to bring a step's block files into the page cache;
``prefetch=True`` ("auto") picks one from the free cores and the tiers. The cache's
``prefetch`` attribute says which one runs; ``offload_stats()`` how often the consumer
had to wait (prefetch lateness).

Device bytes = device tier + sinks + windows + partial blocks + staged blocks: those
the current layer read from lower tiers, and (bounded by its history bytes) the layer
being prefetched. Before every read the device tier is shrunk so that this stays within
``device_budget`` (:mod:`~lessmem.kvcache.tiered.budget`, the policy in
:mod:`lessmem.base.placement`); ``device_peak`` records the maximum. A budget below what
the cache needs even with an empty device tier is warned about once and counted
(``offload_stats()["over_budget"]``). Several caches may share one
:class:`~lessmem.kvcache.tiered.budget.DeviceBudget`.

The parts: :class:`~.blocks.BlockStore` (keys, tiers, reads), :class:`~.budget.DeviceBudget`
and its :class:`~.budget.BudgetAccount` per cache, :class:`~.prefetch.Prefetcher`,
:class:`~.reader.HistoryReader` (the layers' one read path), :class:`~.prefix.PrefixStore`
(save/restore), :class:`~.layer.TieredKVLayer` and :class:`~.cache.TieredKVCache`.

Prefix reuse: with ``set_tokens(ids)`` (``prefill`` calls it) blocks are keyed by the
chained hash of the token prefix, the model id and the cache config, so another cache,
process or machine sharing a tier finds them. ``save_prefix(ids, logits)`` persists the
state after a prompt (blocks to every lower tier, plus one record with the sinks,
windows, partial blocks and the last logits); ``restore_prefix(ids)`` in a fresh cache
loads that state instead of recomputing it — ``prefill(model, ids)`` does both. A prompt
that only *starts* like a stored one loads the blocks of the shared prefix
(``restore_blocks``: the longest run of leading blocks every layer has, plus the exact
sinks) and computes the rest, so requests sharing a system prompt or a document skip it.

Identity and lost blocks (:mod:`~.recovery`): the model id is the fingerprint of the
weights the cache's model holds (``model=``, or bound by ``prefill(model, ...)``), so
another model, a quantized copy or another dtype never restores this state, and equal
weights share it on any machine. A cache that knows only a config shares nothing. A
block a tier lost (Redis down or restarted, evicted, deleted, corrupt) is recomputed
from the known token ids, with one :class:`BlockRecoveryWarning`; restores read and
verify every block first.

Example:
    >>> import torch, tempfile
    >>> from lessmem.models import tiny_random
    >>> from lessmem.kvcache import KVConfig, PRESETS
    >>> from lessmem.kvcache.tiered import TieredKVCache
    >>> model = tiny_random("llama")
    >>> cfg = PRESETS["int4"].replace(window=16, block_size=16)
    >>> cache = TieredKVCache(model.config, cfg, tiers=f"disk:{tempfile.mkdtemp()}",
    ...                       device_budget="40KiB", block_tokens=32)
    >>> logits = cache.prefill(model, torch.arange(1, 200).unsqueeze(0))
    >>> cache.device_peak <= cache.device_budget, cache.memory()["tiers"]["disk"] > 0
    (True, True)
    >>> cache.close()
"""

from __future__ import annotations

from ..cache import quantized_layers
from .blocks import BlockLostError, BlockStore, SealedBlocks
from .budget import BudgetAccount, DeviceBudget
from .cache import TieredKVCache, cache_kwargs
from .layer import TierContext, TieredKVLayer
from .prefetch import Prefetcher, PrefetchStats
from .prefix import PrefixStore
from .reader import HistoryReader
from .recovery import BlockRecoveryWarning, Recovery

__all__ = ["TieredKVCache", "TieredKVLayer", "BlockLostError", "quantized_layers", "cache_kwargs",
           "BlockStore", "SealedBlocks", "DeviceBudget", "BudgetAccount", "Prefetcher", "PrefetchStats",
           "PrefixStore", "HistoryReader", "TierContext", "BlockRecoveryWarning", "Recovery"]
