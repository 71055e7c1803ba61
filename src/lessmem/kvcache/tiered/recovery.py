"""Which model a tiered cache serves, which tokens it holds, and recomputing lost blocks.

**Identity.** Block keys, prefix records and sink records name the model that computed
them. A cache that knows the model (``TieredKVCache(cfg, model=model)``,
``prefill(model, ...)``, ``restore_prefix(ids, model=model)``) names it by
:func:`lessmem.kvcache.identity.model_fingerprint` (the weights it holds, their dtypes
and shapes: path-independent, changed by ``quantize_`` or a dtype cast), unless an
explicit ``model_id=`` was given (then that string is trusted). A cache that knows only
a config is *unbound*: its blocks get keys private to its session, nothing it holds is
shared with other caches or processes, ``restore_prefix``/``restore_blocks`` find
nothing (None / 0) and ``save_prefix`` refuses with a ValueError naming the fix. A
config cannot tell two checkpoints, a quantized model or a bf16 copy apart, so it never
names stored state.

**Tokens.** The cache records the token ids it holds: ``set_tokens``/``prefill``
declare them, and a bound model's forward pre-hook records the ``input_ids`` of every
forward that runs with this cache (``generate``, lessmem's loops, your own), batch 1.

**Recovery.** A block that no tier returns any more (Redis killed, restarted empty or
evicting under ``maxmemory``, a disk block deleted by a peer, a corrupt file) is noticed
where it is read (no extra work on the normal path). When the model and the token ids
are known, the cache truncates every layer to the first lost block, feeds the known
token ids from there through the model again (a nested forward with the same cache),
puts back what the layers already updated in this step had appended, and reads again:
the outer forward continues with the length it started with, so its positions and
masks stay valid. The recomputed tokens are new K/V of the same tokens (computed in
chunks, as a prefill would), so later logits equal an undisturbed run's within the
quantized cache's own tolerance. One :class:`BlockRecoveryWarning` per cache names the
tier(s); ``offload_stats()`` counts ``recoveries`` and ``tokens_recomputed``. Without
the model or the ids the read raises :class:`~.blocks.BlockLostError` saying how to
enable recovery.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..cache import cache_kwargs, check_model_config
from ..identity import model_fingerprint
from .blocks import BlockLostError

_ATTEMPTS = 4  # recoveries tried for one read before the loss is reported as an error


class BlockRecoveryWarning(RuntimeWarning):
    """KV blocks were lost from a tier and their tokens recomputed (once per cache)."""


def _dims(text) -> tuple:
    return (text.num_hidden_layers, getattr(text, "num_key_value_heads", None),
            getattr(text, "head_dim", None), text.hidden_size)


def check_model(model, model_config) -> None:
    """TypeError/ValueError unless ``model`` (None allowed) is a model with this config's shape."""
    if model is None:
        return
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model={type(model).__name__}; allowed: the transformers model "
                        "the cache serves (a torch.nn.Module with .config), or None")
    if _dims(check_model_config(model_config)) != _dims(check_model_config(model.config)):
        raise ValueError("model= does not match the cache's model config (layers, KV heads, "
                         "head_dim, hidden size); allowed: the model whose config built the cache")


def _forward_ids(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1:
        return ids[0].tolist()
    return None


class Recovery:
    """The model binding, the token record and the recovery of one tiered cache."""

    def __init__(self, cache, model_id: str | None):
        self._cache = weakref.ref(cache)
        self.explicit = model_id is not None  # an id the caller vouches for
        self._model = None  # weakref to the bound model
        self._hook = None
        self.ids: list[int] = []  # token ids of positions 0..len-1, as far as known
        self._incoming: list[int] | None = None  # ids of the forward in progress (pre-hook)
        self._step_len = 0  # the cache length when the current forward started
        self._stash: dict[int, tuple] = {}  # layer -> (k, v) it appended in this forward
        self._stashing = False  # whether this forward keeps what it appends (to put it back)
        self._nested = False
        self._warned = False
        self._seen: dict[str, int] = {}  # per tier: errors + corrupt blocks already accounted for
        self.recoveries = 0
        self.tokens_recomputed = 0

    # ---- identity ---------------------------------------------------------------------
    @property
    def model(self):
        return None if self._model is None else self._model()

    def bind(self, model) -> None:
        """Serve ``model``: its fingerprint names the blocks (unless an explicit id was
        given) and its forwards with this cache record their token ids."""
        cache = self._cache()
        check_model(model, cache.model_config)
        fp = None if self.explicit else model_fingerprint(model)
        if self.model is model and (fp is None or fp == cache.store.model_id):
            return
        if cache.get_seq_length() and not self.explicit and cache.store.model_id not in (None, fp):
            raise ValueError("this cache holds state of another model (or of these weights before "
                             "they changed); allowed: the same model, or reset() first")
        self.unbind()
        self._model = weakref.ref(model)
        me = weakref.ref(self)
        self._hook = model.register_forward_pre_hook(
            lambda mod, args, kwargs: (r := me()) and r._on_forward(args, kwargs), with_kwargs=True)
        if fp is not None:
            cache.store.model_id = fp
            cache.store.set_tokens(self.ids)  # content keys from now on

    def unbind(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = self._model = None

    def _on_forward(self, args, kwargs) -> None:
        cache = self._cache()
        if self._nested or cache is None or not any(v is cache for v in kwargs.values()):
            return
        self._incoming = _forward_ids(args, kwargs)

    # ---- tokens -----------------------------------------------------------------------
    def declare(self, ids: list[int]) -> None:
        """The cache holds / will hold ``ids`` from position 0 (``set_tokens``)."""
        self.ids = list(ids)

    def _start_step(self, cache, q: int) -> None:
        """The first layer of a forward: record its ids (when known and contiguous)."""
        self._stash = {}
        self._step_len = n = cache.get_seq_length()
        incoming, self._incoming = self._incoming, None
        if len(self.ids) >= n and incoming is not None and len(incoming) == q:
            del self.ids[n:]  # (in place: a decode step does not copy the whole context)
            self.ids.extend(incoming)
        elif len(self.ids) < n + q:  # fed without known ids: what follows is unknown
            del self.ids[n:]
        self._stashing = self._can_recover(cache) is None

    # ---- the update path --------------------------------------------------------------
    def update(self, base, key_states, value_states, layer_idx, *args, **kwargs):
        """``base(...)`` (KVCache.update), recovering lost blocks when it can."""
        if self._nested:
            return base(key_states, value_states, layer_idx, *args, **kwargs)
        cache = self._cache()
        if layer_idx == 0:
            self._start_step(cache, key_states.shape[2])
        for attempt in range(_ATTEMPTS + 1):
            try:
                out = base(key_states, value_states, layer_idx, *args, **kwargs)
                break
            except BlockLostError as e:
                if attempt == _ATTEMPTS:
                    raise
                self._recover(cache, e)
        if self._stashing and layer_idx < len(cache.layers) - 1:
            self._stash[layer_idx] = (key_states, value_states)
        else:
            self._stash = {}  # the forward is through (or cannot recover): nothing to put back
        return out

    def _can_recover(self, cache) -> str | None:
        """None when lost blocks can be recomputed now, else what is missing."""
        from .layer import TieredKVLayer

        if self.model is None:
            return ("the cache does not know the model: pass model= to TieredKVCache (or fill it "
                    "with prefill(model, ids))")
        if len(self.ids) < self._step_len:
            return ("the token ids of the lost tokens are unknown: feed batch-1 input_ids through "
                    "the bound model, or declare them with set_tokens(ids)")
        if not all(isinstance(layer, TieredKVLayer) for layer in cache.layers):
            return "a layer is not a tiered layer (exact sliding-window layers cannot be truncated)"
        return None

    # ---- recovery ---------------------------------------------------------------------
    def _recover(self, cache, err: BlockLostError) -> None:
        """Recompute from the first lost block to the step's start, then put back what
        this forward's earlier layers appended; BlockLostError when it cannot."""
        why = self._can_recover(cache)
        tiers = ", ".join(t.name for t in cache.store.lower) or "device"
        if why is not None:
            raise BlockLostError(f"{err} (tiers: {tiers}); it cannot be recomputed: {why}",
                                 getattr(err, "key", None)) from err
        cache.prefetcher.drain()  # reads in flight may be stale or failed: forget them
        first_err = err
        for _ in range(_ATTEMPTS):
            target = self._truncate(cache, self._first_lost(cache, err))
            try:
                self._refeed(cache, target)
                break
            except BlockLostError as e:  # lost again while recomputing (e.g. still evicting)
                err = e
        else:
            raise BlockLostError(f"{err} (tiers: {tiers}); recomputing it lost blocks again "
                                 f"{_ATTEMPTS} times", getattr(err, "key", None)) from err
        for i, (k, v) in sorted(self._stash.items()):  # what this forward's earlier layers appended
            _reappend(cache.layers[i], k, v)
        self.recoveries += 1
        self.tokens_recomputed += self._step_len - target
        self._warn(cache, first_err, target)

    def _warn(self, cache, err: BlockLostError, target: int) -> None:
        """One warning per cache, naming the tiers that failed (errors or corrupt blocks
        since the last recovery; else the last tier, where evicted blocks end up)."""
        counts = {t.name: t.stats.errors + t.stats.corrupt for t in cache.store.lower}
        named = [n for n, c in counts.items() if c > self._seen.get(n, 0)]
        self._seen = counts
        if self._warned:
            return
        self._warned = True
        names = ", ".join(named or [cache.store.lower[-1].name if cache.store.lower else "device"])
        what = f"KV block {err.key!r}" if getattr(err, "key", None) else "KV blocks"
        warnings.warn(f"{what} and any others lost from the {names} tier (missing or corrupt) were "
                      f"recomputed: tokens {target}..{self._step_len} fed again from their ids; "
                      "the run continues; further "
                      "recoveries are only counted (offload_stats()['recoveries'])",
                      BlockRecoveryWarning, stacklevel=5)

    def _first_lost(self, cache, err: BlockLostError) -> int:
        """Index of the first block some tiered layer cannot read (one scan per layer,
        oldest first, stopping at its first missing block or at the best found so far)."""
        best = min((len(layer.sealed) for layer in cache.tiered), default=0)
        key = getattr(err, "key", None)
        for layer in cache.tiered:
            if key in layer.block_keys:
                best = min(best, layer.block_keys.index(key))
        store = cache.store
        for layer in cache.tiered:
            keys = layer.block_keys[layer.hidden_blocks():best]
            on_device = store.on_device(keys)
            for j, (k, here) in enumerate(zip(keys, on_device, strict=True)):
                if not here and not store.held_below(k):
                    best = layer.hidden_blocks() + j
                    break
        return best

    def _truncate(self, cache, first: int) -> int:
        """Every layer back to the token before block ``first``; returns that length."""
        target = cache.kv_config.sinks + first * cache.block_tokens
        for layer in cache.layers:
            if layer.quantized:
                _cut_blocks(cache.store, layer, first, target)
            else:
                layer.truncate_to(min(target, layer.length))
        return target

    def _refeed(self, cache, target: int) -> None:
        """Feed the known ids of ``target..`` the step's start through the model again."""
        model, ids = self.model, self.ids
        device = getattr(model, "device", None) or next(model.parameters()).device
        self._nested = True
        try:
            with torch.no_grad():
                for a in range(target, self._step_len, cache.block_tokens):
                    b = min(a + cache.block_tokens, self._step_len)
                    model(torch.tensor([ids[a:b]], device=device), **cache_kwargs(model, cache))
        finally:
            self._nested = False

    def stats(self) -> dict:
        return {"recoveries": self.recoveries, "tokens_recomputed": self.tokens_recomputed}


def _cut_blocks(store, layer, first: int, target: int) -> None:
    """``layer`` keeps its sinks and its first ``first`` sealed blocks (length ``target``)."""
    if not layer.is_initialized:
        return
    sealed = layer.sealed
    n = len(sealed)
    keep = min(first, n)
    for key in sealed.keys[keep:]:
        if store.is_session_key(key):  # content-keyed blocks stay: they may be shared
            store.delete(key)
    parts = {name: b // n * keep for name, b in sealed.part_bytes.items()} if n else {}
    empty = layer.window[0][:, :, :0]
    layer.load(length=target, window=(empty, empty.clone()),
               sealed=(sealed.keys[:keep], sealed.nbytes[:keep], parts), n_history=keep * store.block_tokens,
               pending=None)


def _reappend(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Append ``k``/``v`` to ``layer`` as its update did (without attending)."""
    if layer.quantized:
        layer._append(k, v)
    else:
        layer.keys = torch.cat([layer.keys, k], dim=-2)
        layer.values = torch.cat([layer.values, v], dim=-2)
        layer.length = layer.keys.shape[2]
