"""Paged KV storage for serving: each request's quantized history as a list of pages.

A :class:`Page` is one layer's block of ``block_size`` tokens, encoded once (codes,
scales, zero points laid out as the layer's :class:`~lessmem.formats.kvlayout.KVLayout`
says) and never changed again. Pages live in one :class:`PagePool` shared by every
request of an engine, with a reference count: a request that starts from a cached
prefix references the prefix's pages instead of copying them, and the first block past
the shared prefix is a new page of its own (copy-on-write is free: pages are
immutable). A page is on the device (its tensors held) or in a lower tier (``where``,
under ``key``); attention reads device pages in place, as a
:class:`~lessmem.kernels.attention.SegmentedKV` (no concatenation of the history per
block; :class:`~lessmem.kvcache.layer.QuantizedKVLayer` concatenates within its last
2048-token piece).

:class:`PagedKVCache` is a :class:`~lessmem.kvcache.KVCache` whose quantized layers are
:class:`PagedKVLayer`. Its sinks and window stay with the layer, on the device, in
full precision (unquantized configs keep all keys/values there, in the config's window
dtype: ``fp16`` really stores fp16). A cache can be *snapshotted* (the state after a
prompt prefix: its pages referenced, its full-precision parts shared, both immutable)
and a new cache started from a snapshot; both are what prefix sharing is made of
(:mod:`lessmem.serve.prefix`).

This is the paged layout of vLLM's PagedAttention (Kwon et al., 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention"), with lessmem's
quantized blocks as the pages.
"""

from __future__ import annotations

import itertools

import torch

from ..kernels.attention import QuantKV, SegmentedKV
from ..kvcache.cache import KVCache
from ..kvcache.config import KVConfig
from ..kvcache.layer import _DTYPES, QuantizedKVLayer, _side, count_part
from ..kvcache.presets import resolve
from ..kvcache.tiered.blocks import tensor_bytes
from ..offload.memory import MemoryTier

_ids = itertools.count()


class Page:
    """One layer's block of tokens: ``parts`` (name -> tensor) on the device, or None
    while the page lies in ``where`` (a lower tier) under ``key``."""

    __slots__ = ("id", "parts", "nbytes", "part_bytes", "refs", "key", "where", "staged")

    def __init__(self, parts: dict[str, torch.Tensor]):
        self.id = next(_ids)
        self.parts = parts
        self.part_bytes = {n: tensor_bytes(t) for n, t in parts.items()}
        self.nbytes = sum(self.part_bytes.values())
        self.refs = 0
        self.key: str | None = None
        self.where = None
        self.staged: dict | None = None  # a lower-tier page's parts, read for one step

    @property
    def on_device(self) -> bool:
        return self.parts is not None


class PagePool:
    """Every page of an engine, counted once however many requests reference it."""

    def __init__(self):
        self.device_bytes = 0  # bytes of the pages held on the device
        self.part_bytes: dict[str, int] = {}  # the same, by part name (k_codes, v_scale...)
        self.pages = 0  # live pages (referenced at least once)
        self.epoch = 0  # changes whenever a page leaves or returns to the device
        self._rotations: dict = {}  # one rotation object per (size, seed) for all its caches

    def rotations(self, rots: tuple) -> tuple:
        """The pool's own copy of equal rotations (keys, values): every cache of the pool
        then holds the same objects, so a step's requests are seen to share them."""
        key = tuple(None if r is None else (type(r), r.n, r.seed, r.block) for r in rots)
        return self._rotations.setdefault(key, rots)

    def add(self, parts: dict[str, torch.Tensor]) -> Page:
        page = Page(parts)
        self.pages += 1
        self._count(page, +1)
        return page

    def _count(self, page: Page, sign: int) -> None:
        self.device_bytes += sign * page.nbytes
        for n, b in page.part_bytes.items():
            self.part_bytes[n] = self.part_bytes.get(n, 0) + sign * b

    def ref(self, page: Page) -> Page:
        page.refs += 1
        return page

    def unref(self, page: Page) -> None:
        page.refs -= 1
        if page.refs > 0:
            return
        self.pages -= 1
        self.epoch += 1
        if page.on_device:
            self._count(page, -1)
            page.parts = None
        elif page.where is not None and page.key is not None and page.key.startswith("swap-"):
            try:
                page.where.delete(page.key)
            except Exception:  # noqa: BLE001 (a tier that is gone holds nothing of ours either)
                pass
        page.where = None

    def demote(self, page: Page, tier, key: str) -> bool:
        """Move a device page to ``tier`` under ``key``; False (nothing moved) when the
        tier refuses it or is unreachable."""
        from ..offload import TierFullError, TierUnavailableError

        if not page.on_device:
            return False
        try:
            tier.put(key, page.parts)
        except (TierFullError, TierUnavailableError):
            return False
        if not tier.contains(key):
            return False
        self._count(page, -1)
        page.parts, page.where, page.key = None, tier, key
        self.epoch += 1
        return True

    def _read(self, page: Page) -> dict | None:
        try:
            block = page.where.get(page.key) if page.where is not None else None
        except Exception:  # noqa: BLE001 (an unreachable tier: the page is lost to us)
            return None
        if block is None or block.keys() != page.part_bytes.keys():
            return None
        return {n: block[n] for n in page.part_bytes}

    def stage(self, page: Page) -> bool:
        """Read a lower-tier page for the coming step (``page.staged``); False when lost."""
        return self.stage_all((page,))

    def stage_all(self, pages) -> bool:
        """``stage`` each of ``pages`` in turn, stopping at the first one lost (False): one loop
        without a call per page on the device (a serving step walks every page of every
        request, ~7000 for 16 requests of 1k tokens, most of them on the device)."""
        for p in pages:
            if p.parts is None and p.staged is None:
                p.staged = self._read(p)
                if p.staged is None:
                    return False
        return True

    def promote(self, page: Page) -> bool:
        """Bring a page back onto the device; False when its tier no longer has it."""
        if page.on_device:
            return True
        parts = page.staged if page.staged is not None else self._read(page)
        if parts is None:
            return False
        try:
            page.where.delete(page.key)
        except Exception:  # noqa: BLE001 (its copy there is garbage now, nothing more)
            pass
        page.parts, page.staged, page.where, page.key = parts, None, None, None
        self._count(page, +1)
        self.epoch += 1
        return True


class PagedKVLayer(QuantizedKVLayer):
    """A :class:`QuantizedKVLayer` whose history is a list of pages (module doc)."""

    # No heap trim inside a serving step's prompt chunk: the engine's chunks are short and
    # its next step reuses the freed pages, so giving them back costs the trims and the page
    # faults after them (12 requests x 512 + 96 in-process, best-4, three alternating runs:
    # the chunk steps' sum 9.5-9.6 s with the trims, 8.1-9.0 s without; peak RSS 736-745 vs
    # 755-762 MiB).
    trim_on_prefill = False

    def __init__(self, config: KVConfig, layer_idx: int, rotations, fused, pool: PagePool):
        self.pool = pool
        super().__init__(config, layer_idx, rotations, fused)

    def reset(self) -> None:
        for page in getattr(self, "pages", ()):
            self.pool.unref(page)
        self.pages: list[Page] = []
        self._formats = None
        self._hist = None  # (key, the history as attention reads it) while the pages stay put
        self._fp_memo = None  # (sinks, window buffer, their bytes): fp_bytes
        self.fp_shared = False  # holding a snapshot's full-precision tensors, until the next update
        super().reset()

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        if not self.quantized and self.config.window_dtype in _DTYPES:  # "fp16" stores fp16
            self.store_dtype = _DTYPES[self.config.window_dtype]
            self.keys, self.values = self.keys.to(self.store_dtype), self.values.to(self.store_dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        self.fp_shared = False  # (the window or the keys and values are copied below)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.quantized:
            self.keys = torch.cat([self.keys, key_states.to(self.store_dtype)], dim=-2)
            self.values = torch.cat([self.values, value_states.to(self.store_dtype)], dim=-2)
            self.length = self.keys.shape[2]
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)

    # ---- pages ----------------------------------------------------------------------
    def _append_history(self, new: dict[str, torch.Tensor]) -> None:
        B = self.config.block_size
        n = new["k_codes"].shape[2]
        for t0 in range(0, n, B):
            parts = {}
            for name, t in new.items():
                side, part = name.split("_", 1)
                tg = self.layouts[side].tokens_per_row(part)
                parts[name] = t[:, :, t0 // tg:(t0 + B) // tg].contiguous()
            self.pages.append(self.pool.ref(self.pool.add(parts)))
        self.n_history += n
        self._hist = None

    def read_history(self) -> QuantKV | SegmentedKV | None:
        """The history as attention reads it, kept (with the kernel's pointer table made for
        it) while the pages and the tensors they are read from stay the same. A page staged
        from a memory tier (host RAM) counts by the identity of its tensors, which that tier
        holds and hands back every step (the kept history holds them too, so an identity is
        not reused while it is kept); one staged from another tier (disk, Redis) is a fresh
        copy each step, not kept beyond it."""
        if not self.pages:
            return None
        key, h = (len(self.pages), self.pool.epoch), self._hist  # (the epoch: a page left or came back)
        if h is not None and h[0] == key and (h[2] is None or h[2] == self._staged_ids()):
            return h[1]
        hist = self._read_pages()
        off = [p for p in self.pages if not p.on_device]
        keep = all(isinstance(p.where, MemoryTier) for p in off)  # (an old one would hold demoted pages' tensors)
        self._hist = (key, hist, self._staged_ids() if off else None) if keep else None
        return hist

    def _staged_ids(self) -> tuple:
        return tuple(tuple(map(id, p.staged.values())) for p in self.pages if p.staged is not None)

    def _read_pages(self) -> QuantKV | SegmentedKV:
        D = self.head_dim

        def kv(p):
            return QuantKV(_side(self.kspec, p["k_codes"], p["k_scale"], p.get("k_zero_point"), D),
                           _side(self.vspec, p["v_codes"], p["v_scale"], p.get("v_zero_point"), D))
        first = self.pages[0].parts if self.pages[0].parts is not None else self.pages[0].staged
        if len(self.pages) == 1:
            return kv(first)
        if self._formats is None:
            self._formats = kv(first)
        f = self._formats
        kz, vz = f.keys.zero_point is not None, f.values.zero_point is not None
        parts = [p.parts if p.parts is not None else p.staged for p in self.pages]
        return SegmentedKV(f.keys, f.values,
                           tuple((p["k_codes"], p["k_scale"], p["k_zero_point"] if kz else None) for p in parts),
                           tuple((p["v_codes"], p["v_scale"], p["v_zero_point"] if vz else None) for p in parts),
                           self.config.block_size)

    def blocks(self):
        raise NotImplementedError("a paged layer's blocks are its pages (PagedKVLayer.pages)")

    # ---- what the engine counts ---------------------------------------------------------
    def fp_tensors(self) -> list[torch.Tensor]:
        """The full-precision tensors this layer holds (sinks, window, unquantized keys/values)."""
        if not self.is_initialized:
            return []
        parts = [self.keys, self.values] if not self.quantized else [*(self.sinks or (None, None)),
                                                                      *(self.window or (None, None))]
        return [t for t in parts if t is not None]

    def fp_bytes(self) -> int:
        """Bytes of the full-precision tensors this layer holds, what the engine budgets: the
        unquantized keys and values, or the sinks and the window's whole buffer (its tokens
        rounded up to ``WINDOW_GRAIN``, ``QuantizedKVLayer._window_append``: the capacity is
        held, not only the tokens in it). Remembered until the sinks or the buffer change (the
        engine asks every layer of every request a few times a step)."""
        if not self.is_initialized:
            return 0
        if not self.quantized:
            return tensor_bytes(self.keys) + tensor_bytes(self.values)
        sinks, held = self.sinks, self.window_held()
        memo = self._fp_memo
        if memo is not None and memo[0] is sinks and memo[1] is held:
            return memo[2]
        n = sum(tensor_bytes(t) for pair in (sinks, held) if pair for t in pair)
        self._fp_memo = (sinks, held, n)
        return n

    def memory(self) -> dict[str, int]:
        m = super().memory()
        if not self.quantized or not self.is_initialized:
            if self.is_initialized and not self.quantized:
                m["window"] = self.fp_bytes()
            return m
        for page in self.pages:
            for name, b in page.part_bytes.items():
                count_part(m, name, b)
        m["quant_elements"] = self.batch_size * self.num_heads * self.n_history * self.head_dim
        return m

    # ---- snapshots ------------------------------------------------------------------------
    _STATE = ("device", "dtype", "batch_size", "num_heads", "head_dim", "layouts", "store_dtype",
              "is_initialized", "sinks", "window", "keys", "values", "n_history", "length")

    def snapshot(self) -> dict:
        """The layer's state now; its pages get one more reference (release with
        :func:`release_snapshot`). What it holds never changes: the layer replaces its
        tensors, and the window is copied out of the buffer the layer goes on writing into
        (which would also keep the buffer's room alive with the snapshot)."""
        state = {k: getattr(self, k, None) for k in self._STATE}
        if state["window"] is not None:  # its own copy: the layer's buffer has room for more
            state["window"] = (state["window"][0].clone(), state["window"][1].clone())
        state["pages"] = [self.pool.ref(p) for p in self.pages]
        return state

    def load_snapshot(self, state: dict, probe: torch.Tensor | None = None) -> None:
        """Start from ``state`` (this layer must be empty): shares its pages and tensors.
        A state read back from a tier holds only tensors and counts; ``probe`` (an empty
        ``[1, kv_heads, 0, head_dim]`` tensor of the model's dtype and device) sets the rest."""
        if "is_initialized" not in state:
            self.lazy_initialization(probe, probe)
            state = {**{k: getattr(self, k) for k in self._STATE}, **state}
        for k in self._STATE:
            setattr(self, k, state[k])
        self.pages = [self.pool.ref(p) for p in state["pages"]]
        self._formats = self._hist = None
        self.fp_shared = True


def release_snapshot(pool: PagePool, states: list[dict]) -> None:
    """Drop the page references a cache snapshot (one state per layer) holds."""
    for state in states:
        for p in state["pages"]:
            pool.unref(p)


class PagedKVCache(KVCache):
    """A :class:`~lessmem.kvcache.KVCache` over a shared :class:`PagePool` (module doc).

    Example:
        >>> import torch, lessmem
        >>> from lessmem.models import tiny_random
        >>> model = tiny_random("llama")
        >>> pool = PagePool()
        >>> with lessmem.kvcache.enable(model):
        ...     cache = PagedKVCache(model.config, "int4", pool)
        ...     _ = model(torch.arange(200)[None], cache=cache)  # older transformers: past_key_values=
        >>> pool.pages == sum(len(layer.pages) for layer in cache.layers) > 0
        True
    """

    def __init__(self, model_config, config: str | KVConfig, pool: PagePool, attention: str = "auto"):
        self.pool = pool
        super().__init__(model_config, resolve(config), attention)

    def _new_layer(self, layer_idx: int) -> PagedKVLayer:
        self.rotations = self.pool.rotations(self.rotations)
        return PagedKVLayer(self.kv_config, layer_idx, self.rotations, self._fused, self.pool)

    def fp_shared(self) -> bool:
        """Whether a layer still holds a prefix snapshot's full-precision tensors (copied at
        its next update; ``fp_bytes`` counts them until then, ``Engine._held``)."""
        return any(layer.fp_shared for layer in self.paged_layers())

    def paged_layers(self) -> list[PagedKVLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedKVLayer)]

    def fp_bytes(self) -> int:
        """Full-precision bytes held (sinks, windows, unquantized layers): on the device always."""
        return sum(layer.fp_bytes() for layer in self.paged_layers())

    def pages(self) -> list[Page]:
        """Every page of every layer, in layer order."""
        return [p for layer in self.paged_layers() for p in layer.pages]

    def snapshot(self) -> list[dict]:
        return [layer.snapshot() for layer in self.paged_layers()]

    def load_snapshot(self, states: list[dict], probe: torch.Tensor | None = None) -> None:
        for layer, state in zip(self.paged_layers(), states, strict=True):
            layer.load_snapshot(state, probe)

    def swap_out(self, tier, key: str) -> bool:
        """Move what this cache holds alone to ``tier``: its own pages (shared ones stay)
        and its full-precision parts (record ``swapfp-<key>``). False when the tier refused
        something: what moved stays readable there, the rest stays on the device."""
        from ..offload import TierFullError, TierUnavailableError

        ok = True
        for page in self.pages():
            if page.refs == 1 and page.on_device:
                ok = self.pool.demote(page, tier, f"swap-{key}-{page.id}") and ok
        if not ok:
            return False
        record = {}
        for i, layer in enumerate(self.paged_layers()):
            for j, t in enumerate(layer.fp_tensors()):
                record[f"L{i}.{j}"] = t
        try:
            tier.put(f"swapfp-{key}", record)
        except (TierFullError, TierUnavailableError):
            return False
        if not tier.contains(f"swapfp-{key}"):
            return False
        for layer in self.paged_layers():
            if layer.is_initialized:
                if layer.quantized:
                    layer.sinks = layer.window = None
                else:
                    layer.keys = layer.values = None
        return True

    def swap_in(self, tier, key: str) -> bool:
        """Restore the full-precision parts :meth:`swap_out` moved (pages stay where they
        are until staged or promoted); False when the tier lost them."""
        try:
            record = tier.get(f"swapfp-{key}")
        except Exception:  # noqa: BLE001 (unreachable: the state is lost, recompute)
            record = None
        if record is None:
            return False
        for i, layer in enumerate(self.paged_layers()):
            if not layer.is_initialized:
                continue
            t = [record[f"L{i}.{j}"] for j in range(4 if layer.quantized else 2)]
            if layer.quantized:
                layer.sinks, layer.window = (t[0], t[1]), (t[2], t[3])
            else:
                layer.keys, layer.values = t
        try:
            tier.delete(f"swapfp-{key}")
        except Exception:  # noqa: BLE001
            pass
        return True

    def free(self) -> None:
        """Drop every reference this cache holds (pages go when no one else holds them)."""
        for layer in self.paged_layers():
            layer.reset()
