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
Prefetch, ``prefetch="gather"``: while layer i computes, a background thread gathers
layer i+1 (reads, checks and stages its blocks; after the last layer: layer 0 for the
next step), which hides the whole read when a core is free for it, and a remote tier's
network wait always. ``prefetch="hint"``: once a step, the disk tier's native thread
asks the OS to bring every block file the step will read into the page cache
(``posix_fadvise(WILLNEED)``: hides the disk's latency, costs the decoding thread
neither a Python thread nor the GIL); the decoding thread then reads and checks each
layer's blocks on all its cores between the model's parallel ops. ``prefetch=True``
("auto") picks "gather" when the process has a core that torch's threads leave free or
a tier is remote, else "hint": with every core computing, a background copy and
checksum only take time from the model (measured on 2 cores: no gain, a few % lost).
``offload_stats()`` says how often the consumer had to wait (prefetch lateness).

Device bytes = device tier + sinks + windows + partial blocks + staged blocks: those
the current layer read from lower tiers, and (bounded by its history bytes) the layer
being prefetched. Before every read the device tier is
shrunk so that this stays within ``device_budget``; ``device_peak`` records the maximum.

Prefix reuse: with ``set_tokens(ids)`` (``prefill`` calls it) blocks are keyed by the
chained hash of the token prefix, the model id and the cache config, so another cache,
process or machine sharing a tier finds them. ``save_prefix(ids, logits)`` persists the
state after a prompt (blocks to every lower tier, plus one record with the sinks,
windows, partial blocks and the last logits); ``restore_prefix(ids)`` in a fresh cache
loads that state instead of recomputing it — ``prefill(model, ids)`` does both. A prompt
that only *starts* like a stored one loads the blocks of the shared prefix
(``restore_blocks``: the longest run of leading blocks every layer has, plus the exact
sinks) and computes the rest, so requests sharing a system prompt or a document skip it.

Example:
    >>> import torch, tempfile
    >>> from lessmem.models import tiny_random
    >>> from lessmem.kvcache import KVConfig, PRESETS
    >>> from lessmem.kvcache.tiered import TieredKVCache
    >>> model = tiny_random("llama")
    >>> cfg = PRESETS["int4"].replace(window=16, block_size=16)
    >>> cache = TieredKVCache(model.config, cfg, tiers=f"disk:{tempfile.mkdtemp()}",
    ...                       device_budget="24KiB", block_tokens=32)
    >>> logits = cache.prefill(model, torch.arange(1, 200).unsqueeze(0))
    >>> cache.device_peak <= cache.device_budget, cache.memory()["tiers"]["disk"] > 0
    (True, True)
    >>> cache.close()
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace

import torch

from ..kernels.attention import QuantKV, SegmentedKV
from ..offload import (
    DeviceTier,
    PrefetchHandle,
    Tier,
    TierFullError,
    TierSpec,
    TierStack,
    block_nbytes,
    build_tiers,
    check_block_tokens,
    layer_key,
    parse_bytes,
    parse_offload_spec,
    prefix_hashes,
    sequence_hash,
)
from ..offload.stack import PrefetchStats
from .cache import KVCache, cache_kwarg, quantized_layers
from .config import KVConfig
from .layer import QuantizedKVLayer, _side


class BlockLostError(RuntimeError):
    """A sealed block is in no tier any more (corrupted, deleted or evicted from the last tier)."""


def _nb(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class TieredKVLayer(QuantizedKVLayer):
    """A quantized layer whose history lives in the owner's tiers as sealed blocks."""

    def __init__(self, config: KVConfig, layer_idx: int, rotations, fused, owner: TieredKVCache):
        self.owner = owner
        super().__init__(config, layer_idx, rotations, fused)

    def reset(self) -> None:
        super().reset()
        if hasattr(self.owner, "_version"):
            self.owner._version += 1
        self.block_keys: list[str] = []
        self.block_bytes: list[int] = []
        self.part_bytes: dict[str, int] = {}
        self.pending: dict[str, torch.Tensor] | None = None  # the partly filled block
        self.n_pending = 0
        self._pend = (None, 0)  # (the pending dict measured, its bytes): fp_bytes runs per layer per step
        self._tok_bytes = None
        self._sum = (0, 0)  # (len(block_bytes), sum(block_bytes)) cached
        self._sides = None  # a QuantKV whose formats the segments of read_history share

    # groups of tokens per row of each part (scales/zero points of per-channel keys)
    def _tg(self, name: str) -> int:
        if "codes" in name:
            return 1
        spec = self.kspec if name.startswith("k_") else self.vspec
        return spec.group_shape(self.head_dim)[0]

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.owner._version += 1

    def _append_history(self, new: dict[str, torch.Tensor]) -> None:
        self.owner._version += 1  # invalidates the owner's per-step sums
        n = new["k_codes"].shape[2]
        if self.pending is None:
            self.pending = {k: t.contiguous() for k, t in new.items()}
        else:
            self.pending = {k: torch.cat([self.pending[k], t], dim=2) for k, t in new.items()}
        self.n_history += n
        self.n_pending += n
        bt = self.owner.block_tokens
        while self.n_pending >= bt:
            head = {k: t[:, :, : bt // self._tg(k)].clone() for k, t in self.pending.items()}
            self.n_pending -= bt
            self.pending = ({k: t[:, :, bt // self._tg(k):].clone() for k, t in self.pending.items()}
                            if self.n_pending else None)
            self.owner._seal(self, head)

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner._chunk = key_states.shape[2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        hidden = self.owner._hidden_tokens(self)
        return self.length + query_length - hidden, hidden

    def token_bytes(self) -> int:
        """Full-precision bytes one more token adds to this layer (keys + values)."""
        if not self.is_initialized:
            return 0
        if self._tok_bytes is None:
            elem = torch.empty(0, dtype=self.store_dtype).element_size()
            self._tok_bytes = 2 * self.batch_size * self.num_heads * self.head_dim * elem
        return self._tok_bytes

    def _kv(self, h: dict) -> QuantKV:
        D = self.head_dim
        return QuantKV(_side(self.kspec, h["k_codes"], h["k_scale"], h.get("k_zero_point"), D),
                       _side(self.vspec, h["v_codes"], h["v_scale"], h.get("v_zero_point"), D))

    def read_history(self) -> QuantKV | SegmentedKV | None:
        parts = self.owner._history_for(self)
        if not parts:
            return None
        bt = self.owner.block_tokens
        # (block_tokens is a multiple of block_size, itself a multiple of both token groups)
        if len(parts) == 1 or parts[0]["k_codes"].device.type != "cpu":
            return self._kv(_join(parts))
        # the blocks as they lie (device tier) or arrived (lower tiers): read in place
        if self._sides is None:  # the formats (bits, groups, level table) of this layer, no data
            kv, e = self._kv(parts[0]), torch.empty(0, dtype=torch.uint8)

            def fmt(x):
                return replace(x, codes=e, scale=e, zero_point=None if x.zero_point is None else e)
            self._sides = QuantKV(fmt(kv.keys), fmt(kv.values))
        t = self._sides
        kz, vz = t.keys.zero_point is not None, t.values.zero_point is not None
        return SegmentedKV(t.keys, t.values,
                           tuple((p["k_codes"], p["k_scale"], p["k_zero_point"] if kz else None) for p in parts),
                           tuple((p["v_codes"], p["v_scale"], p["v_zero_point"] if vz else None) for p in parts),
                           bt)

    def _pending_bytes(self) -> int:
        p = self.pending
        if p is None:
            return 0
        if self._pend[0] is not p:  # pending is replaced, never mutated in place
            self._pend = (p, sum(_nb(t) for t in p.values()))
        return self._pend[1]

    def history_bytes(self) -> int:
        if self._sum[0] != len(self.block_bytes):
            self._sum = (len(self.block_bytes), sum(self.block_bytes))
        return self._sum[1] + self._pending_bytes()

    def fp_bytes(self) -> int:
        """Bytes of what always stays on the device: sinks, window, partial block."""
        if not self.is_initialized:
            return 0
        if not self.quantized:
            return _nb(self.keys) + _nb(self.values)
        tokens = self.sinks[0].shape[2] + self.window[0].shape[2]
        return tokens * self.token_bytes() + self._pending_bytes()

    def blocks(self):
        from .block import KVBlock

        return [KVBlock(self.config.sinks + i * self.owner.block_tokens, self.owner.block_tokens,
                        self.owner._fetch(k)) for i, k in enumerate(self.block_keys)]

    def memory(self) -> dict[str, int]:
        m = super().memory()  # sinks, window, tokens (self.history stays None); history below
        if not self.quantized or not self.is_initialized:
            return m
        parts = dict(self.part_bytes)
        for k, t in (self.pending or {}).items():
            parts[k] = parts.get(k, 0) + _nb(t)
        for name, b in parts.items():
            part = "codes" if name.endswith("codes") else ("scales" if name.endswith("scale") else "zero_points")
            m[part] += b
            m["k_quant_bytes" if name.startswith("k_") else "v_quant_bytes"] += b
        m["quant_elements"] = self.batch_size * self.num_heads * self.n_history * self.head_dim
        return m

    def _map(self, fn) -> None:
        if self.block_keys or self.pending is not None:
            raise ValueError("a tiered cache cannot reorder or select batch rows of offloaded "
                             "history; allowed: batch operations before any block is written")
        super()._map(fn)


def _join(parts: list[dict]) -> dict:
    """One block dict from consecutive parts (tokens along dim 2)."""
    if len(parts) == 1:
        return parts[0]
    return {n: torch.cat([p[n] for p in parts], dim=2) for n in parts[0]}


def cache_kwargs(model, cache) -> dict:
    """Forward kwargs passing ``cache`` under :func:`cache_kwarg`, with ``use_cache``."""
    return {cache_kwarg(model): cache, "use_cache": True}


def _tiers_from(tiers) -> list[Tier]:
    specs = parse_offload_spec(tiers) if isinstance(tiers, str) else tiers
    if isinstance(specs, list) and any(isinstance(t, TierSpec) and t.kind == "device" for t in specs):
        raise ValueError("the device tier is implicit; set its size with device_budget")
    return build_tiers("host" if specs is None else specs)


class TieredKVCache(KVCache):
    """Quantized KV cache over tiers; see the module doc.

    ``tiers``: lower tiers (fastest first) as a spec string (``"host,disk:/path"``), a
    list of :class:`~lessmem.offload.Tier` or :class:`~lessmem.offload.TierSpec`.
    ``device_budget``: bytes (or ``"64MiB"``) the cache may hold on the device; None =
    unbounded. ``block_tokens``: tokens per stored block (multiple of the config's
    ``block_size``). ``write_policy``: ``"write-back"`` or ``"write-through"``.
    ``model_id``: names the model in block keys (default: from the model config).
    ``attention_window``: None (attend to everything; the tiers only move bytes) or the
    sliding-window policy: attend to the most recent blocks covering at least this many
    tokens (a multiple of ``block_tokens``; needs ``sinks=0``) plus the window, while the
    older blocks stay in the tiers for prefix reuse and are never read while decoding.
    ``prefetch``: True (auto), "gather", "hint" or False (see the module doc).
    """

    def __init__(self, model_config, config: str | KVConfig = "int4", tiers=None, device_budget=None,
                 block_tokens: int = 256, prefetch: bool | str = True, write_policy: str = "write-back",
                 attention: str = "auto", model_id: str | None = None,
                 attention_window: int | None = None):
        super().__init__(model_config, config, attention)
        check_block_tokens(block_tokens, self.kv_config.block_size)
        self.block_tokens = block_tokens
        if attention_window is not None:
            if isinstance(attention_window, bool) or not isinstance(attention_window, int) \
                    or attention_window < block_tokens or attention_window % block_tokens:
                raise ValueError(f"attention_window={attention_window!r}; allowed: None or a positive "
                                 f"multiple of block_tokens {block_tokens}")
            if self.kv_config.sinks:
                raise ValueError(f"attention_window needs a config with sinks=0 (got sinks="
                                 f"{self.kv_config.sinks}); allowed: e.g. config.replace(sinks=0)")
        self.attention_window = attention_window
        self.device_budget = None if device_budget is None else parse_bytes(device_budget)
        if prefetch not in (True, False, None, "auto", "gather", "hint"):
            raise ValueError(f"prefetch={prefetch!r}; allowed: True/'auto', 'gather', 'hint', False")
        self.prefetch = bool(prefetch)
        self._prefetch_choice = "auto" if prefetch is True else (prefetch or None)
        self.device_tier = DeviceTier(None, device="cpu")
        self.stack = TierStack([self.device_tier, *_tiers_from(tiers)], write_policy=write_policy,
                               promote=False)
        self.lower = self.stack.tiers[1:]
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.model_id = model_id or "{}:{}:L{}:H{}:KV{}:D{}".format(
            getattr(text, "_name_or_path", "") or "model", getattr(text, "model_type", "?"),
            text.num_hidden_layers, text.hidden_size, getattr(text, "num_key_value_heads", 0),
            getattr(text, "head_dim", 0) or 0)
        self.key_config = {**self.kv_config.to_dict(), "block_tokens": block_tokens}
        self.session = uuid.uuid4().hex[:16]
        for i, layer in enumerate(self.layers):
            if isinstance(layer, QuantizedKVLayer):
                self.layers[i] = TieredKVLayer(self.kv_config, i, self.rotations, self._fused, self)
        self.tiered = [la for la in self.layers if isinstance(la, TieredKVLayer) and la.quantized]
        self._qlayers = [la for la in self.layers if isinstance(la, QuantizedKVLayer)]
        self.prefetch_stats = PrefetchStats()
        self._plock = threading.Lock()
        self._pool = None
        self._inflight: dict[int, tuple[tuple, PrefetchHandle, int]] = {}  # "gather": next layer
        self._hints: list[tuple] = []  # "hint": (tier, ticket) of the last page-cache advice
        self._staged = 0
        self._chunk = 1
        self.device_peak = 0
        self.over_budget = 0  # reads at which even an empty device tier could not meet the budget
        self.prefill_skipped = 0
        self.prefix_tokens_reused = 0  # prompt tokens loaded from the tiers instead of computed
        self._hashes: list[str] = []
        self._version = 0  # bumped whenever a layer's blocks or partial block change
        self._sums: dict[str, tuple] = {}

    @classmethod
    def from_cache(cls, src: KVCache, **kwargs) -> TieredKVCache:
        """A tiered copy of a filled in-memory :class:`KVCache` (same config and model
        config; ``kwargs`` as for the constructor): its sinks and windows are copied,
        its quantized history is cut into blocks and placed in the tiers."""
        import copy

        new = cls(src.model_config, src.kv_config, attention=src.attention, **kwargs)
        feeds = []
        for i, s in enumerate(src.layers):
            d = new.layers[i]
            if not isinstance(d, TieredKVLayer) or not isinstance(s, QuantizedKVLayer):
                new.layers[i] = copy.deepcopy(s)
                continue
            if not s.is_initialized:
                continue
            probe = torch.empty(s.batch_size, s.num_heads, 0, s.head_dim, dtype=s.dtype, device=s.device)
            d.lazy_initialization(probe, probe)
            if not s.quantized:
                d.keys, d.values, d.length = s.keys.clone(), s.values.clone(), s.length
                continue
            d.sinks = (s.sinks[0].clone(), s.sinks[1].clone())
            d.window = (s.window[0].clone(), s.window[1].clone())
            d.length = s.length
            if s.history is not None:
                feeds.append((d, s.history, s.n_history))
        # position-major, so that the device tier's LRU order is the age of the tokens
        bt = new.block_tokens
        for t0 in range(0, max((n for _, _, n in feeds), default=0), bt):
            for d, h, n in feeds:
                if t0 < n:
                    t1 = min(n, t0 + bt)
                    d._append_history({k: t[:, :, t0 // d._tg(k):t1 // d._tg(k)].clone()
                                       for k, t in h.items()})
        new.tiered = [la for la in new.layers if isinstance(la, TieredKVLayer) and la.quantized]
        new._qlayers = [la for la in new.layers if isinstance(la, QuantizedKVLayer)]
        return new

    def to_kvcache(self) -> KVCache:
        """An in-memory :class:`KVCache` holding the same state (every block gathered)."""
        out = KVCache(self.model_config, self.kv_config, attention=self.attention)
        for i, d in enumerate(self.layers):
            s = out.layers[i]
            if not isinstance(d, TieredKVLayer) or not d.is_initialized:
                continue
            probe = torch.empty(d.batch_size, d.num_heads, 0, d.head_dim, dtype=d.dtype, device=d.device)
            s.lazy_initialization(probe, probe)
            s.length = d.length
            if not d.quantized:
                s.keys, s.values = d.keys.clone(), d.values.clone()
                continue
            s.sinks = (d.sinks[0].clone(), d.sinks[1].clone())
            s.window = (d.window[0].clone(), d.window[1].clone())
            parts = self._gather(d, list(d.block_keys), d.pending)
            s.history = _join(parts) if parts else None
            s.n_history = d.n_history
        return out

    def set_device_budget(self, device_budget) -> None:
        """Change the device budget (bytes or ``"64MiB"``; None = unbounded) and demote to fit."""
        self.device_budget = None if device_budget is None else parse_bytes(device_budget)
        if self.device_budget is None:
            self.device_tier.resize(None)
        self._rebalance()

    # ---- keys ----------------------------------------------------------------------------
    def set_tokens(self, token_ids) -> None:
        """Declare the token ids the cache holds/will hold (batch 1): blocks fully inside
        them are keyed by content (shareable); other blocks get session keys."""
        ids = torch.as_tensor(token_ids).reshape(-1) if not isinstance(token_ids, torch.Tensor) \
            else token_ids
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"token ids of batch {ids.shape[0]}; allowed: batch 1 for prefix keys")
            ids = ids[0]
        s = self.kv_config.sinks
        hs = prefix_hashes(ids.tolist(), self.block_tokens, self.model_id, self.key_config, first_block=s)
        self._hashes = hs[1:] if s else hs

    def _key_for(self, layer: TieredKVLayer, idx: int) -> str:
        if idx < len(self._hashes):
            return layer_key(self._hashes[idx], layer.layer_idx)
        return f"s{self.session}-b{idx:05d}-L{layer.layer_idx:02d}"

    # ---- placement ------------------------------------------------------------------------
    def _seal(self, layer: TieredKVLayer, block: dict) -> None:
        key = self._key_for(layer, len(layer.block_keys))
        nb = block_nbytes(block)
        layer.block_keys.append(key)
        layer.block_bytes.append(nb)
        for k, t in block.items():
            layer.part_bytes[k] = layer.part_bytes.get(k, 0) + _nb(t)
        self.device_tier.device = block["k_codes"].device
        self._rebalance()
        try:
            self.stack.put(key, block)
        except TierFullError as e:
            raise TierFullError(f"no tier can take block {key!r} ({nb} bytes): {e}") from e

    def fp_bytes(self) -> int:
        return sum(la.fp_bytes() for la in self._qlayers)

    @property
    def prefetch_mode(self) -> str | None:
        """What the prefetcher does now: "gather", "hint" or None (see the module doc)."""
        if self._prefetch_choice != "auto":
            return self._prefetch_choice
        import os

        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        if cores > torch.get_num_threads() or any(t.kind == "remote" for t in self.lower):
            return "gather"
        return "hint"

    def _reserve(self) -> int:
        """Room for staged blocks: the layer computing now and the prefetched one (kept in
        "hint" mode too: "auto" may switch modes when torch's thread count changes, and the
        planner's split does not depend on the machine's cores)."""
        key = (self._version, self.prefetch, len(self.tiered))
        if self._sums.get("reserve", (None,))[0] != key:
            biggest = max((la.history_bytes() - sum(la.block_bytes[:self._hidden_blocks(la)])
                           for la in self.tiered), default=0)
            self._sums["reserve"] = (key, biggest * (2 if self.prefetch else 1))
        return self._sums["reserve"][1]

    def _token_bytes(self) -> int:
        """Full-precision bytes one more token adds to all quantized layers together."""
        key = (self._version, len(self.layers))
        if self._sums.get("token", (None,))[0] != key:
            self._sums["token"] = (key, sum(la.token_bytes() for la in self._qlayers))
        return self._sums["token"][1]

    def _rebalance(self, fp: int | None = None) -> None:
        if self.device_budget is None:
            return
        # what the layers still to run in this forward add to their windows
        growth = self._chunk * self._token_bytes()
        fp = self.fp_bytes() if fp is None else fp
        room = self.device_budget - fp - growth - self._reserve()
        if room < 0:
            self.over_budget += 1
        self.device_tier.resize(max(0, room))

    def device_bytes(self, fp: int | None = None) -> int:
        """Bytes held on the device now (see module doc)."""
        inflight = sum(nb for _, _, nb in self._inflight.values())
        fp = self.fp_bytes() if fp is None else fp
        return self.device_tier.nbytes + fp + self._staged + inflight

    def _fetch(self, key: str) -> dict:
        for _ in range(2):  # a block may be moving between tiers: look twice
            b = self.device_tier.get(key, touch=False)
            if b is not None:
                return b
            for t in self.lower:
                b = t.get(key)
                if b is not None:
                    return b
        raise BlockLostError(f"KV block {key!r} is in no tier (corrupted, deleted or evicted "
                             "from the last tier); give the last tier more capacity")

    def _gather(self, layer: TieredKVLayer, keys: list[str], pending, threads: int = 1) -> list[dict]:
        """The layer's blocks in order (device-tier blocks by reference, lower-tier blocks
        as the copies just read, ``threads`` files at a time) plus the partial block."""
        parts = self.device_tier.get_many(keys, touch=False)
        todo = [i for i, p in enumerate(parts) if p is None]
        for t in self.lower:  # the rest in one batch per tier (DiskTier: one GIL-free call)
            if not todo:
                break
            got = t.get_many([keys[i] for i in todo], threads=threads)
            for i, b in zip(todo, got, strict=True):
                parts[i] = b
            todo = [i for i in todo if parts[i] is None]
        for i in todo:  # moved between tiers meanwhile, or lost: look again, or raise
            parts[i] = self._fetch(keys[i])
        if pending is not None:
            parts.append(pending)
        dev = layer.device
        if any(p["k_codes"].device != dev for p in parts):
            parts = [{n: t.to(dev) for n, t in p.items()} for p in parts]
        return parts

    def _submit(self, fn, *args) -> PrefetchHandle:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lessmem-kv-prefetch")
        with self._plock:
            self.prefetch_stats.issued += 1
        return PrefetchHandle(self._pool.submit(fn, *args), self.prefetch_stats, self._plock)

    def _advise(self, keys: list[str]) -> None:
        """Prefetch "hint": ask each lower tier that can (disk) to bring these blocks closer
        (page cache) from its native thread; the decoding thread reads them. A hint not
        carried out by the next one counts as late. Without the compiled reader there is
        no native thread and no hint (a Python thread would take the GIL from decoding)."""
        with self._plock:
            for tier, ticket in self._hints:  # the previous step's: carried out in time?
                if tier.advise_done(ticket):
                    self.prefetch_stats.on_time += 1
                else:
                    self.prefetch_stats.late += 1
            self._hints = []
        for t in self.lower:
            ticket = t.advise_async(keys) if keys else None
            if ticket is not None:
                with self._plock:
                    self.prefetch_stats.issued += 1
                    self._hints.append((t, ticket))

    def _hidden_blocks(self, layer: TieredKVLayer) -> int:
        """Sealed blocks outside the attention window (sliding policy), oldest first."""
        if self.attention_window is None:
            return 0
        return max(0, len(layer.block_keys) - self.attention_window // self.block_tokens)

    def _hidden_tokens(self, layer: TieredKVLayer) -> int:
        return self._hidden_blocks(layer) * self.block_tokens

    def _visible(self, layer: TieredKVLayer) -> list[str]:
        return list(layer.block_keys[self._hidden_blocks(layer):])

    def _history_for(self, layer: TieredKVLayer) -> dict | None:
        snap = (len(layer.block_keys), layer.n_pending)
        got = self._inflight.pop(layer.layer_idx, None)
        self._staged = 0  # the previous layer's gathered history is no longer used
        hist = None
        if got is not None:
            out = got[1].result()  # the next layer gathered in the background ("gather")
            hist = out if got[0] == snap else None  # stale: blocks sealed since
        if hist is None:
            # on the decoding thread, between the model's parallel ops: read on all its cores
            hist = self._gather(layer, self._visible(layer), layer.pending, torch.get_num_threads())
        fp = self.fp_bytes()
        self._rebalance(fp)
        # held beside the device tier: the blocks read from lower tiers, and any block the
        # rebalance just demoted that this read still references
        h0 = self._hidden_blocks(layer)
        held = self.device_tier.contains_many(layer.block_keys[h0:])
        self._staged = sum(b for b, on in zip(layer.block_bytes[h0:], held, strict=True) if not on)
        mode = self.prefetch_mode if len(self.tiered) > 1 else None
        if mode == "gather":
            nxt = self.tiered[(self.tiered.index(layer) + 1) % len(self.tiered)]
            if nxt.block_keys:
                fut = self._submit(self._gather, nxt, self._visible(nxt), nxt.pending)
                self._inflight[nxt.layer_idx] = ((len(nxt.block_keys), nxt.n_pending), fut,
                                                 nxt.history_bytes())
        elif mode == "hint" and layer is self.tiered[0]:  # once a step: every layer's blocks
            self._advise([k for la in self.tiered for k in self._visible(la)])
        self.device_peak = max(self.device_peak, self.device_bytes(fp))
        return hist

    # ---- prefix persistence -----------------------------------------------------------------
    def _state_key(self, ids) -> str:
        return "state-" + sequence_hash(ids, self.model_id, self.key_config)

    def save_prefix(self, token_ids, logits: torch.Tensor | None = None) -> str:
        """Persist the state after ``token_ids`` (see module doc); returns the record key."""
        ids = torch.as_tensor(token_ids).reshape(-1).tolist()
        if self.get_seq_length() != len(ids):
            raise ValueError(f"the cache holds {self.get_seq_length()} tokens, token_ids has "
                             f"{len(ids)}; allowed: the ids the cache was filled with")
        self._check_restorable()
        self._drain()  # block keys may change below: no gather may be in flight
        self.set_tokens(ids)
        rec: dict[str, torch.Tensor] = {"length": torch.tensor([len(ids)])}
        if logits is not None:
            rec["logits"] = logits.detach().float().cpu()
        for la in self.tiered:
            i = la.layer_idx
            for idx, key in enumerate(la.block_keys):
                want = self._key_for(la, idx)
                missing = [t for t in self.lower if not t.contains(want)]
                block = self._fetch(key) if missing else None  # stored blocks are not read again
                self._put_some(missing, want, block)
                if key != want:  # a session key becomes the shareable content key
                    self.stack.delete(key)
                    la.block_keys[idx] = want
            rec[f"L{i}.probe"] = torch.empty(la.batch_size, la.num_heads, 0, la.head_dim, dtype=la.dtype)
            rec[f"L{i}.sinks_k"], rec[f"L{i}.sinks_v"] = la.sinks
            rec[f"L{i}.window_k"], rec[f"L{i}.window_v"] = la.window
            rec[f"L{i}.block_bytes"] = torch.tensor(la.block_bytes, dtype=torch.int64)
            rec[f"L{i}.n_history"] = torch.tensor([la.n_history])
            for k, t in (la.pending or {}).items():
                rec[f"L{i}.p.{k}"] = t
        key = self._state_key(ids)
        self._put_some(self.lower, key, rec)
        s = self.kv_config.sinks
        if s and len(ids) >= s:  # the exact sinks, for prompts that share only a prefix with this one
            srec = {k: v for k, v in rec.items() if ".sinks_" in k or k.endswith(".probe")}
            skey = self._sinks_key(ids[:s])
            self._put_some([t for t in self.lower if not t.contains(skey)], skey, srec)
        return key

    @staticmethod
    def _put_some(tiers: list, key: str, block: dict) -> None:
        """Put into every tier that can take it (a small host tier may not hold a prompt's
        state record); TierFullError only when none of them could."""
        errors = []
        for t in tiers:
            try:
                t.put(key, block)
            except TierFullError as e:
                errors.append(f"{t.name}: {e}")
        if tiers and len(errors) == len(tiers):
            raise TierFullError(f"no tier can store {key!r}: " + "; ".join(errors))

    def _sinks_key(self, ids) -> str:
        return "sinks-" + sequence_hash(ids, self.model_id, self.key_config)

    def restore_blocks(self, token_ids, dtype=None, device=None) -> int:
        """Load the longest run of leading blocks of ``token_ids`` that the lower tiers hold
        for every layer (saved by any cache with the same model id and config, e.g. for a
        prompt that shares only a prefix with this one), leaving at least one token to
        compute; returns the tokens restored (0: nothing found, the cache stays empty).

        The restored tokens are quantized history, exactly as stored; the caller feeds the
        rest of the prompt. The result is not bit-identical to a full prefill: there, the
        later prompt tokens attended to the last restored ones while those were still in
        the full-precision window (a difference of the same kind as the cache's own)."""
        self._check_restorable()
        if self.get_seq_length():
            raise ValueError("restore_blocks needs an empty cache; allowed: a fresh cache or after reset()")
        ids = torch.as_tensor(token_ids).reshape(-1).tolist()
        s, bt = self.kv_config.sinks, self.block_tokens
        srec = None
        if s:
            srec = next((r for r in (t.get(self._sinks_key(ids[:s])) for t in self.lower) if r is not None),
                        None) if len(ids) > s else None
            if srec is None:
                return 0
        self.set_tokens(ids)
        n = min(len(self._hashes), (len(ids) - s - 1) // bt)
        k = 0
        while k < n and all(any(t.contains(self._key_for(la, k)) for t in self.lower) for la in self.tiered):
            k += 1
        if not k:
            return 0
        text = self.model_config.get_text_config() if hasattr(self.model_config, "get_text_config") \
            else self.model_config
        for la in self.tiered:
            i = la.layer_idx
            keys = [self._key_for(la, b) for b in range(k)]
            first = self._fetch(keys[0])
            if srec is not None:
                probe = srec[f"L{i}.probe"]
            else:
                D = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
                probe = torch.empty(first["k_codes"].shape[0], first["k_codes"].shape[1], 0, D,
                                    dtype=dtype or getattr(text, "torch_dtype", None) or torch.float32)
            probe = probe.to(device) if device is not None else probe
            la.lazy_initialization(probe, probe)
            if srec is not None:
                la.sinks = (srec[f"L{i}.sinks_k"].to(probe.device), srec[f"L{i}.sinks_v"].to(probe.device))
            la.block_keys, la.block_bytes = keys, [block_nbytes(first)] * k
            la.n_history, la.n_pending, la.pending = k * bt, 0, None
            la.length = s + k * bt
            la.part_bytes = {name: _nb(t) * k for name, t in first.items()}
        self._version += 1
        self.prefix_tokens_reused += s + k * bt
        return s + k * bt

    def _check_restorable(self) -> None:
        if len(self.tiered) != len(self.layers):
            raise ValueError("prefix save/restore needs every layer quantized; allowed: configs "
                             "without skip_layers and models without exact sliding-window layers")

    def restore_prefix(self, token_ids) -> torch.Tensor | None:
        """Load the state saved for exactly ``token_ids``; returns its logits (or an empty
        tensor if none were saved), or None when no complete record is found."""
        self._check_restorable()
        if self.get_seq_length():
            raise ValueError("restore_prefix needs an empty cache; allowed: a fresh cache or after reset()")
        ids = torch.as_tensor(token_ids).reshape(-1).tolist()
        key = self._state_key(ids)
        rec = next((r for r in (t.get(key) for t in self.lower) if r is not None), None)
        if rec is None:
            return None
        self.set_tokens(ids)
        for la in self.tiered:
            i = la.layer_idx
            n_blocks = len(rec[f"L{i}.block_bytes"])
            keys = [self._key_for(la, b) for b in range(n_blocks)]
            if not all(any(t.contains(k) for t in self.lower) for k in keys):
                self.reset()
                return None
            probe = rec[f"L{i}.probe"]
            la.lazy_initialization(probe, probe)
            dev = probe.device
            la.sinks = (rec[f"L{i}.sinks_k"].to(dev), rec[f"L{i}.sinks_v"].to(dev))
            la.window = (rec[f"L{i}.window_k"].to(dev), rec[f"L{i}.window_v"].to(dev))
            la.block_keys, la.block_bytes = keys, rec[f"L{i}.block_bytes"].tolist()
            la.n_history = int(rec[f"L{i}.n_history"][0])
            la.n_pending = la.n_history - n_blocks * self.block_tokens
            pend = {k.split(".p.", 1)[1]: t.to(dev) for k, t in rec.items() if k.startswith(f"L{i}.p.")}
            la.pending = pend or None
            la.length = int(rec["length"][0])
            la.part_bytes = self._part_bytes_of(la, keys)
        self._version += 1
        self.prefill_skipped += 1
        self.prefix_tokens_reused += len(ids)
        return rec.get("logits", torch.empty(0))

    def _part_bytes_of(self, la: TieredKVLayer, keys: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        if keys:
            first = self._fetch(keys[0])  # every block of a layer has the same part sizes
            for k, t in first.items():
                out[k] = _nb(t) * len(keys)
        return out

    def prefill(self, model, input_ids: torch.Tensor, chunk: int | None = None, save: bool = True,
                reuse_prefix: bool = True):
        """Logits [B, vocab] after ``input_ids``: restored from the tiers when this exact
        prompt was saved before (prefill skipped); else, with ``reuse_prefix``, the leading
        blocks the tiers hold for this prompt's prefix are loaded (:meth:`restore_blocks`)
        and only the rest is computed, in chunks of ``chunk`` tokens (default
        ``block_tokens``); saved when ``save``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}; allowed: [batch, tokens]")
        single = input_ids.shape[0] == 1 and len(self.tiered) == len(self.layers)
        start = 0  # prompt tokens already in the cache (restored blocks)
        if single and not self.get_seq_length():
            logits = self.restore_prefix(input_ids[0])
            if logits is not None and logits.numel():
                return logits.to(model.device if hasattr(model, "device") else "cpu")
            if logits is not None:
                raise ValueError("the saved prefix has no logits; allowed: restore_prefix() then feed a token")
            self.set_tokens(input_ids[0])
            if reuse_prefix:
                start = self.restore_blocks(input_ids[0], dtype=getattr(model, "dtype", None),
                                            device=getattr(model, "device", None))
        step = chunk or self.block_tokens
        out = None
        with torch.no_grad():
            for a in range(start, input_ids.shape[1], step):
                out = model(input_ids[:, a:a + step], **cache_kwargs(model, self))
        logits = out.logits[:, -1].float()
        if save and single:
            self.save_prefix(input_ids[0], logits)
        return logits

    # ---- reporting / lifecycle ---------------------------------------------------------------
    def memory(self) -> dict:
        """``KVCache.memory()`` plus ``device_bytes``, ``device_peak`` and ``tiers`` (bytes per tier)."""
        out = super().memory()
        out.update(device_bytes=self.device_bytes(), device_peak=self.device_peak,
                   device_budget=self.device_budget, tiers=self.stack.placement())
        return out

    def offload_stats(self) -> dict:
        """Per-tier hits, misses, bytes moved, GB/s; prefetch on-time/late counts."""
        out = self.stack.stats()
        out["prefetch"] = self.prefetch_stats.to_dict()
        out["prefill_skipped"] = self.prefill_skipped
        out["prefix_tokens_reused"] = self.prefix_tokens_reused
        out["over_budget"] = self.over_budget
        return out

    def _drain(self) -> None:
        for _, h, _ in getattr(self, "_inflight", {}).values():
            h.future.result()
        self._inflight = {}
        for tier, ticket in getattr(self, "_hints", []):
            tier.advise_done(ticket, wait=True)
        self._hints = []
        self._staged = 0

    def reset(self) -> None:
        self._drain()
        super().reset()

    def close(self, keep_session: bool = False) -> None:
        """Stop the prefetcher, drop this session's (non-shareable) blocks, close the tiers."""
        self._drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if not keep_session:
            for la in self.tiered:
                for k in la.block_keys:
                    if k.startswith("s" + self.session):
                        self.stack.delete(k)
        self.stack.close(flush=False)

    def __repr__(self) -> str:
        return (f"TieredKVCache(layers={len(self.layers)}, config={self.kv_config}, "
                f"tiers={[t.name for t in self.stack.tiers]}, device_budget={self.device_budget})")


__all__ = ["TieredKVCache", "TieredKVLayer", "BlockLostError", "quantized_layers", "cache_kwargs"]
