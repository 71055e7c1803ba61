"""The serving engine: many requests, one model, one KV budget.

:class:`Engine` keeps a queue of requests and runs *steps*. Each step

1. admits waiting (and swapped-out) requests while the device KV budget has room for
   their next chunk and the running ones can still grow (a watermark of one block each);
   a new request first looks its prompt up in the prefix cache (:mod:`.prefix`);
2. picks the step's tokens: one decode token per running request that has finished its
   prompt, and whole prompt chunks (``chunk_tokens``, always at the same aligned
   positions) of prefilling requests, oldest first, while ``step_tokens`` allows (at least
   ``chunk_tokens + max_running``: a chunk always fits beside the decode tokens) — so a
   long prompt is spread over steps and never stalls the others (chunked prefill,
   Agrawal et al., 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with
   Sarathi-Serve");
3. makes room if the step would not fit: least recently used prefix snapshots go first;
   then, with a lower tier, the oldest pages of running requests move down (they stay
   readable there: the window and sinks stay on the device); only then the newest
   running request is preempted — swapped out to the lower tier (``preempt="swap"``) or
   dropped and recomputed later (``"recompute"``, replaying exactly the tokens it had,
   prompt chunks then one token per step, so its output is unchanged);
4. runs one forward pass over the packed tokens (:mod:`.batch`), samples the requests
   whose logits are due (greedy at temperature 0; else temperature and top-p, with a
   per-request seeded generator), and reports every new token to the request's listener.

Requests join and leave the running set at every step (continuous batching, Yu et al.,
2022, "Orca"). Each request's KV lives in a :class:`~.paged.PagedKVCache` of the
configured format over the engine's one :class:`~.paged.PagePool`.

Example:
    >>> import lessmem
    >>> from lessmem.models import tiny_random
    >>> engine = Engine(tiny_random("llama"), None, EngineConfig(kv="int4", kv_budget="4MiB"))
    >>> reqs = [engine.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0)) for _ in range(3)]
    >>> while engine.step():
    ...     pass
    >>> [len(r.output_ids) for r in reqs], engine.metrics()["requests_finished"]
    ([4, 4, 4], 3)
    >>> engine.close()
"""

from __future__ import annotations

import itertools
import numbers
import sys
import threading
import time
import uuid
import warnings
from collections import deque

import torch

from ..base.placement import window_capacity
from ..kvcache.attention import enable
from ..kvcache.cache import cache_kwarg
from ..kvcache.identity import model_fingerprint
from ..kvcache.layer import count_part
from ..kvcache.shape import head_dim as model_head_dim
from ..kvcache.tiered.blocks import tensor_bytes
from ..offload import DiskTier, HostTier, RedisTier, TierUnavailableError, build_tiers
from .batch import BatchCache, RowPlan, Segment
from .config import EngineConfig, SamplingParams
from .paged import PagedKVCache, PagePool
from .prefix import PrefixCache
from .request import Request, TokenEvent
from .text import sample, text_delta

METRICS_EVERY_S = 0.2  # how stale metrics() may be while a step runs in another thread
_TIER_KINDS = (("host", HostTier), ("disk", DiskTier), ("redis", RedisTier))
FINISH_REASONS = ("stop", "length", "abort")


class Engine:
    """Continuous batching over paged, quantized KV under one budget (module doc).

    ``model``: a transformers causal LM (switched to lessmem attention while the engine
    lives); ``tok``: its tokenizer (None: token ids only, no text or stop strings);
    ``config``: an :class:`EngineConfig`."""

    def __init__(self, model, tok, config: EngineConfig | None = None, model_name: str | None = None):
        self.config = (config or EngineConfig()).check()
        cfg = self.config
        text = model.config.get_text_config()
        types = set(getattr(text, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"} or getattr(text, "sliding_window", None) and getattr(
                text, "use_sliding_window", True):
            raise ValueError(f"the serving engine runs full-attention models; this one has layers "
                             f"{sorted(types)} (sliding window {getattr(text, 'sliding_window', None)}); "
                             "allowed: models whose every layer attends to the whole context")
        self.model, self.tok = model.eval(), tok
        self.model_name = model_name or getattr(model.config, "_name_or_path", None) or "model"
        self.max_context = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
        self.kv = cfg.kv
        self._switch = enable(model)
        self._plan = RowPlan(model) if cfg.batch_invariant else None
        # a model with lessmem's lean decode switch (lessmem.load turns it on) takes steps of
        # decode rows only without transformers' forward (LeanDecode.serve_step)
        self._lean = getattr(model, "_lessmem_lean", None)
        self._kwarg = cache_kwarg(model)
        self.layers = text.num_hidden_layers
        self._kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self._head_dim = model_head_dim(text)
        p = next(model.parameters())
        self._probe = torch.empty(1, self._kv_heads, 0, self._head_dim, dtype=p.dtype, device=p.device)
        self.device = p.device
        fp_elem = 2 if self.kv.window_dtype in ("fp16", "bf16") or not self.kv.keys.quantized else 4
        if not self.kv.keys.quantized and self.kv.window_dtype not in ("fp16", "bf16", "fp32"):
            fp_elem = p.element_size()
        self.fp_token_bytes = self.layers * 2 * self._kv_heads * self._head_dim * fp_elem
        self._measure_bytes()
        self.pool = PagePool()
        self.tiers = build_tiers(cfg.offload) if cfg.offload else []
        self.swap_tier = self.tiers[0] if self.tiers else None
        persist = next((t for t in reversed(self.tiers) if isinstance(t, (DiskTier, RedisTier))), None)
        self.model_id = model_fingerprint(model)
        key_config = {**self.kv.to_dict(), "chunk": cfg.chunk_tokens, "invariant": cfg.batch_invariant}
        self.prefix = PrefixCache(self.pool, self.model_id, key_config, cfg.chunk_tokens,
                                  self.kv.block_size, self.kv.sinks if self.kv.keys.quantized else 0,
                                  persist) if cfg.prefix_cache else None
        self.preempt_policy = cfg.preempt if cfg.preempt != "auto" else ("swap" if self.swap_tier else "recompute")
        self.session = uuid.uuid4().hex[:12]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._lock = threading.Condition()  # the queues, shared with submitting threads
        self._step_lock = threading.RLock()  # a step's changes, against metrics() from other threads
        self._last_metrics: dict | None = None
        self._metrics_at = 0.0
        self._aborts: set[str] = set()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.counters = dict(steps=0, prompt_tokens=0, computed_prompt_tokens=0, output_tokens=0,
                             requests_finished=0, preemptions=0, demoted_pages=0, max_running=0,
                             peak_device_bytes=0, over_budget_steps=0, recomputes=0, step_seconds=0.0,
                             lean_steps=0)
        self.finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self._eos = []  # the tokenizer's end token and the generation config's (a chat turn's end)
        for eos in (getattr(tok, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                    getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            for t in ([eos] if isinstance(eos, int) else list(eos or [])):
                if t not in self._eos:
                    self._eos.append(t)
        self._last_metrics = self._metrics()

    # ---- requests -------------------------------------------------------------------
    def check_request(self, prompt_ids, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The checked (prompt ids, params); ValueError naming what is wrong (nothing queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}; allowed: a SamplingParams")
        params = params.check()
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("the prompt is empty; allowed: at least one token")
        vocab = self.model.config.get_text_config().vocab_size
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        n = len(prompt_ids) + params.max_tokens
        if n > self.max_context:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"is {n} tokens; allowed: at most the model's context, {self.max_context}")
        return [int(t) for t in prompt_ids], params

    def submit(self, prompt_ids, params: SamplingParams | None = None, listener=None,
               request_id: str | None = None) -> Request:
        """Queue a request (checked first, see :meth:`check_request`); returns it."""
        prompt_ids, params = self.check_request(prompt_ids, params or SamplingParams())
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()).item())
        req = Request(rid, prompt_ids, params, listener, generator=torch.Generator().manual_seed(seed))
        with self._lock:
            if rid in self.requests:
                raise ValueError(f"request_id={rid!r} is already in use; allowed: a new id")
            req.order = next(self._order)
            self.requests[rid] = req
            self.waiting.append(req)
            self.counters["prompt_tokens"] += len(prompt_ids)
            self._lock.notify_all()
        return req

    def abort(self, request_id: str) -> None:
        """Finish a request with ``"abort"`` and free its KV at the next step (any thread)."""
        with self._lock:
            if request_id in self.requests:
                self._aborts.add(request_id)
                self._lock.notify_all()

    # ---- bytes ------------------------------------------------------------------------
    def device_bytes(self) -> int:
        fp = sum(r.cache.fp_bytes() for r in self.running if r.cache is not None)
        fp += sum(r.cache.fp_bytes() for r in self.swapped if r.cache is not None)
        return self.pool.device_bytes + fp + (self.prefix.fp_bytes if self.prefix else 0)

    def _measure_bytes(self) -> None:
        """What a request's bytes are made of, from a scratch cache of this config filled up to
        its first block in the pages: the bytes of a page of each quantized layer together
        (``_block_bytes``, measured: every scale and zero point counted), of a full-precision
        token in the quantized layers (sinks, window: ``_fp_q``) and in the unquantized ones
        (``_fp_u``), as the layers store them. ``request_bytes`` adds them up."""
        pool = PagePool()
        cache = PagedKVCache(self.model.config, self.kv, pool, attention="reference")
        self._block_bytes = self._fp_q = self._fp_u = 0
        if self.kv.keys.quantized:
            n = self.kv.sinks + self.kv.window + self.kv.block_size  # one block moves into the pages
            g = torch.Generator().manual_seed(0)
            for i in range(self.layers):
                k = torch.randn(1, self._kv_heads, n, self._head_dim, generator=g).to(self._probe.dtype)
                cache.update(k, k.clone(), i)
            for layer in cache.paged_layers():  # a token's keys and values as the layer stores them
                token = 2 * layer.batch_size * layer.num_heads * layer.head_dim * layer.store_dtype.itemsize
                if layer.quantized:
                    self._fp_q += token
                else:
                    self._fp_u += token
            self._block_bytes = pool.device_bytes
        cache.free()

    def request_bytes(self, n_tokens: int) -> int:
        """Device bytes one request holds at ``n_tokens`` tokens: an unquantized cache's tokens,
        or a quantized one's sinks, pages (the blocks moved out of its window) and window
        buffer (its tokens rounded up to ``WINDOW_GRAIN``), and its unquantized layers'
        tokens. Exact: the same count as ``device_bytes`` makes of the tensors after a step
        (``tests/serve/test_engine.py`` checks it)."""
        if not self.kv.keys.quantized:
            return n_tokens * self.fp_token_bytes
        sinks = min(n_tokens, self.kv.sinks)
        blocks = self._blocks(n_tokens)
        window = n_tokens - sinks - blocks * self.kv.block_size
        fp = (sinks + window_capacity(window)) * self._fp_q + n_tokens * self._fp_u
        return fp + blocks * self._block_bytes

    def _blocks(self, n_tokens: int) -> int:
        """Blocks a quantized cache has moved into its pages after ``n_tokens`` tokens."""
        return max(0, (n_tokens - self.kv.sinks - self.kv.window) // self.kv.block_size)

    def _peak_bytes(self, n0: int, n1: int) -> int:
        """The most device bytes a request holds on its way from ``n0`` to ``n1`` tokens: at
        ``n1``, or, for a quantized cache, with its window's buffer at its fullest, the token
        before the last block it moves into the pages on the way (the bytes drop there:
        a block's codes take less than its tokens did in the window)."""
        peak = self.request_bytes(n1)
        if self.kv.keys.quantized:
            before = self.kv.sinks + self.kv.window + self._blocks(n1 + 1) * self.kv.block_size - 1
            if self._blocks(n1 + 1) and n0 < before <= n1:
                peak = max(peak, self.request_bytes(before))
        return peak

    def _page_bytes(self, n_tokens: int) -> int:
        """Bytes of the pages a quantized cache holds after ``n_tokens`` tokens."""
        return self._blocks(n_tokens) * self._block_bytes

    def _grow(self, n0: int, n1: int, held: int | None = None) -> int:
        """Device bytes a request's cache may add going from ``n0`` to ``n1`` tokens: each new
        token in full precision, or the most it holds on the way (``_peak_bytes``) less what
        it holds now (``held``, as ``device_bytes`` counts it; ``request_bytes(n0)`` unless
        given, see ``_held``)."""
        held = self.request_bytes(n0) if held is None else held
        return max((n1 - n0) * self.fp_token_bytes, self._peak_bytes(n0, n1) - held)

    def _held(self, req: Request) -> int:
        """Device bytes ``device_bytes`` counts for a running request now: ``request_bytes``,
        or, while it still shares a prefix snapshot's full-precision tensors (its next update
        copies them into its own: ``PagedKVLayer.fp_shared``), the snapshot's pages and
        those tensors as they are (a snapshot's window is a copy of its tokens, without the
        buffer's room; ``device_bytes`` counts them with the request and with the snapshot
        until then, so the copy needs no bytes beyond the request's own)."""
        n = req.n_cached
        if req.cache is not None and req.cache.fp_shared():
            return self._page_bytes(n) + req.cache.fp_bytes()
        return self.request_bytes(n)

    def _step_bytes(self, batch) -> int:
        """Device bytes a step's tokens may add (``_grow`` for each request)."""
        return sum(self._grow(r.n_cached, r.n_cached + len(t), self._held(r)) for r, t, _, _ in batch)

    def _prefix_bytes(self, p: int) -> int:
        """Bytes a request starting from a ``p``-token prefix snapshot shares with it: the pages
        (its full-precision tensors are copied at its first update)."""
        return int(self._page_bytes(p)) if self.kv.keys.quantized else 0

    def _outstanding(self) -> int:
        """Bytes the running requests' prompts will still add before they decode."""
        return sum(max(0, self._peak_bytes(r.n_cached, len(r.prompt_ids)) - self._held(r))
                   for r in self.running if r.n_cached < len(r.prompt_ids))

    def _fits(self, extra: int) -> bool:
        b = self.config.kv_budget
        return b is None or self.device_bytes() + extra <= b

    def _need(self, req: Request) -> int:
        """Device bytes the request's next step adds (its tokens, in full precision first)."""
        return self._grow(req.n_cached, req.n_cached + self._tokens_next(req))

    def _tokens_next(self, req: Request) -> int:
        n = len(req.prompt_ids)
        if req.n_cached < n:
            C = self.config.chunk_tokens
            return min(n, (req.n_cached // C + 1) * C) - req.n_cached
        return 1

    def _watermark(self) -> int:
        """Room for the running requests' next block of tokens after their prompts: what each
        adds on the way (a block of full-precision tokens each for an unquantized cache; for a
        quantized one, up to its window's fullest buffer)."""
        B = self.kv.block_size
        return sum(self._peak_bytes(n, n + B) - self.request_bytes(n)
                   for n in (max(r.n_cached, len(r.prompt_ids)) for r in self.running))

    # ---- scheduling -------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, token: int | None = None, delta: str = "") -> None:
        req.finish_reason = reason
        req.state = "finished"
        if req.cache is not None:
            req.cache.free()
            req.cache = None
        if req.swap_key and self.swap_tier is not None:
            try:
                self.swap_tier.delete(f"swapfp-{req.swap_key}")
            except Exception:  # noqa: BLE001
                pass
        self.counters["requests_finished"] += 1
        self.finished_by_reason[reason] += 1
        with self._lock:
            self.requests.pop(req.id, None)
        req.done.set()
        self._emit(req, TokenEvent(req.id, token, delta, True, reason))

    @staticmethod
    def _emit(req: Request, ev: TokenEvent) -> None:
        if req.listener is not None:
            try:
                req.listener(ev)
            except Exception as e:  # noqa: BLE001 (a listener's bug must not stop the engine)
                warnings.warn(f"listener of {req.id} raised {e!r}", RuntimeWarning, stacklevel=2)

    def _take_aborts(self) -> None:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        for rid in ids:
            for q in (self.waiting, self.swapped):
                for r in list(q):
                    if r.id == rid:
                        q.remove(r)
                        self._finish(r, "abort")
            for r in list(self.running):
                if r.id == rid:
                    self.running.remove(r)
                    self._finish(r, "abort")

    def _new_cache(self, req: Request) -> None:
        req.cache = PagedKVCache(self.model.config, self.kv, self.pool)
        req.n_cached = 0
        if self.prefix is not None:
            if req.hashes is None:
                req.hashes = self.prefix.chunk_hashes(req.prompt_ids)
            self.prefix.queries += 1
            self._jump(req, tier=True)

    def _jump(self, req: Request, tier: bool = False) -> None:
        """Start ``req`` from the longest snapshot beyond what it has computed, if any."""
        p, states = self.prefix.lookup(req.prompt_ids, req.hashes, beyond=req.n_cached, tier=tier)
        if p:
            req.cache.free()
            req.cache.load_snapshot(states, self._probe)
            if not req.cached_tokens:
                self.prefix.hits += 1
            self.prefix.tokens_reused += p - req.n_cached
            req.n_cached = p
            req.cached_tokens = max(req.cached_tokens, p)

    def _follows(self, r: Request, ahead: list[Request]) -> bool:
        """True when an older request is computing the chunk ``r`` needs next (``r``
        waits a step and then starts from its snapshot instead of computing it too)."""
        if self.prefix is None or r.hashes is None:
            return False
        i = r.n_cached // self.config.chunk_tokens
        if i >= len(r.hashes) or (i + 1) * self.config.chunk_tokens >= len(r.prompt_ids):
            return False
        h = r.hashes[i]
        return any(q.hashes is not None and len(q.hashes) > i and q.hashes[i] == h
                   and q.n_cached <= i * self.config.chunk_tokens for q in ahead)

    def _admit(self) -> None:
        while len(self.running) < self.config.max_running:
            with self._lock:
                src = self.swapped if self.swapped else (self.waiting if self.waiting else None)
                if src is None:
                    return
                req = src[0]
            if req.state == "swapped":
                need = self._need(req) + self._outstanding() + self._watermark()
                if not self._fits(need) and not self._make_room(need):
                    return
                with self._lock:
                    src.popleft()
                if not req.cache.swap_in(self.swap_tier, req.swap_key):
                    self._reset_for_recompute(req)
                req.swap_key = None
            else:  # room for its whole prompt (less a prefix it will share), what the others'
                # prompts still add, a block each
                p, key = 0, None
                if self.prefix is not None:
                    if req.hashes is None:
                        req.hashes = self.prefix.chunk_hashes(req.prompt_ids)
                    p, key = self.prefix.peek(req.prompt_ids, req.hashes)
                need = self._peak_bytes(0, len(req.prompt_ids) + 1) - self._prefix_bytes(p) \
                    + self._outstanding() + self._watermark()
                if not self._fits(need) and not self._make_room(need, {key}):
                    if self.running or self.config.kv_budget is None:
                        return
                    # nothing runs and it still does not fit: run it anyway (counted), never deadlock
                with self._lock:
                    src.popleft()
                self._new_cache(req)
            req.state = "running"
            self.running.append(req)

    def _reset_for_recompute(self, req: Request) -> None:
        if req.cache is not None:
            req.cache.free()
        req.cache = PagedKVCache(self.model.config, self.kv, self.pool)
        req.n_cached = 0
        self.counters["recomputes"] += 1

    def _wanted(self) -> set[str]:
        """Snapshots a running request may still start from (kept while others go)."""
        C = self.config.chunk_tokens
        return {h for r in self.running if r.hashes is not None and r.n_cached < len(r.prompt_ids)
                for h in r.hashes[r.n_cached // C:]}

    def _make_room(self, need: int, protect=()) -> bool:
        """Free device bytes until ``need`` more fit: prefix snapshots (not those in
        ``protect`` or wanted by running requests), then (with a lower tier) pages of
        running requests; True when it fits. Without a lower tier nothing is evicted
        unless evicting is enough."""
        protect = set(protect) | self._wanted() if self.prefix is not None else set()
        if self.swap_tier is None and self.prefix is not None \
                and not self._fits(need - self.prefix.freeable(protect)):
            return False
        while not self._fits(need):
            if self.prefix is not None and self.prefix.evict(protect):
                continue
            if self.swap_tier is None or not self._demote_one():
                return False
        return True

    def _demote_one(self) -> bool:
        """Move one device page that only one running request holds to the lower tier
        (the oldest page of the request holding most device pages)."""
        best, best_n = None, 0
        for r in self.running:
            if r.cache is None:
                continue
            n = sum(1 for p in r.cache.pages() if p.on_device and p.refs == 1)
            if n > best_n:
                best, best_n = r, n
        if best is None:
            return False
        for layer_pages in zip(*(layer.pages for layer in best.cache.paged_layers()), strict=False):
            for p in layer_pages:
                if p.on_device and p.refs == 1:
                    if self.pool.demote(p, self.swap_tier, f"swap-{self.session}-{p.id}"):
                        self.counters["demoted_pages"] += 1
                        return True
                    return False
        return False

    def _preempt_one(self) -> bool:
        if len(self.running) <= 1:
            return False
        victim = max(self.running, key=lambda r: r.order)
        self.running.remove(victim)
        victim.preemptions += 1
        self.counters["preemptions"] += 1
        if self.preempt_policy == "swap" and victim.cache is not None:
            key = f"{self.session}-{victim.id}"
            if victim.cache.swap_out(self.swap_tier, key):
                victim.swap_key, victim.state = key, "swapped"
                with self._lock:
                    self.swapped.appendleft(victim)
                return True
        victim.cache.free()
        victim.cache, victim.n_cached, victim.state = None, 0, "waiting"
        self.counters["recomputes"] += 1
        with self._lock:
            self.waiting.appendleft(victim)
        return True

    def _schedule(self) -> list[tuple[Request, list[int], bool, bool]]:
        """(request, tokens, is_chunk, sample) of the step: decodes first, then chunks."""
        budget = self.config.step_tokens
        out = []
        for r in sorted(self.running, key=lambda r: r.order):
            if r.n_cached >= len(r.prompt_ids) and budget >= 1:
                i = r.n_cached - len(r.prompt_ids)  # the next token is an output token
                out.append((r, [r.output_ids[i]], False, i == len(r.output_ids) - 1))
                budget -= 1
        ahead = []
        for r in sorted(self.running, key=lambda r: r.order):
            if r.n_cached < len(r.prompt_ids):
                if self.prefix is not None and r.hashes is not None:
                    self._jump(r)
                    if self._follows(r, ahead):
                        continue
                    ahead.append(r)
                n = self._tokens_next(r)
                if n > budget:
                    break
                end = r.n_cached + n
                out.append((r, r.prompt_ids[r.n_cached:end], True,
                            end == len(r.prompt_ids) and not r.output_ids))
                budget -= n
        return out

    def _stage(self, batch) -> list:
        """Read the lower-tier pages the step needs; requests with a lost page are reset."""
        if not self.tiers:  # every page is on the device
            return batch
        keep = []
        for item in batch:
            r = item[0]
            if self.pool.stage_all(r.cache.pages()):
                keep.append(item)
            else:
                warnings.warn(f"{r.id}: a KV page was lost from the lower tier; recomputing it",
                              RuntimeWarning, stacklevel=3)
                self._reset_for_recompute(r)
        return keep

    def _unstage(self, batch) -> int:
        if not self.tiers:
            return 0
        staged = 0
        for r, *_ in batch:
            if r.cache is None:
                continue
            for p in r.cache.pages():
                if p.staged is not None:
                    staged += p.nbytes
                    p.staged = None
        return staged

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> int:
        """One scheduler step (module doc); returns the number of requests still
        unfinished (0: idle)."""
        with self._step_lock:
            n = self._step()
            now = time.perf_counter()
            if now - self._metrics_at >= METRICS_EVERY_S or not n:  # (a disk tier's bytes are a file read)
                self._last_metrics, self._metrics_at = self._metrics(), now
            return n

    def _step(self) -> int:
        t0 = time.perf_counter()
        self._take_aborts()
        self._admit()
        batch = self._schedule()
        while batch:
            grow = self._step_bytes(batch)
            if self._fits(grow) or self._make_room(grow):
                break
            if not self._preempt_one():
                self.counters["over_budget_steps"] += 1
                break
            batch = self._schedule()
        if not batch:
            return self._pending()
        batch = self._stage(batch)
        if batch:
            self._forward(batch)
        self.counters["steps"] += 1
        self.counters["step_seconds"] += time.perf_counter() - t0
        return self._pending()

    def _pending(self) -> int:
        with self._lock:
            return len(self.waiting) + len(self.running) + len(self.swapped)

    def _forward(self, batch) -> None:
        ids, pos, segments, keep, samplers = [], [], [], [], []
        for r, toks, is_chunk, due in batch:
            s = len(ids)
            ids.extend(toks)
            pos.extend(range(r.n_cached, r.n_cached + len(toks)))
            segments.append(Segment(s, len(ids), r.cache, is_chunk))
            if due:
                keep.append(len(ids) - 1)
                samplers.append(r)
        self.counters["max_running"] = max(self.counters["max_running"], len(self.running))
        dev = self.device
        logits, cache = None, BatchCache(segments, self.layers)
        if self._lean is not None and len(segments) == len(ids) and not any(s.chunk for s in segments):
            # decode rows only: the lean step (None, the cache untouched, where the model can't take
            # it). Rows a recomputed request replays (not sampled) are computed and their logits dropped.
            with torch.inference_mode():
                logits = self._lean.serve_step(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), cache)
            if logits is not None and len(keep) < len(ids):
                logits = logits[torch.tensor(keep, dtype=torch.long, device=dev)]
            self.counters["lean_steps"] += logits is not None
        if logits is None:
            kwargs = {self._kwarg: cache, "use_cache": True,
                      "logits_to_keep": torch.tensor(keep or [0], device=dev)}
            token = self._plan.step(segments) if self._plan is not None else None
            try:
                with torch.inference_mode():
                    logits = self.model(input_ids=torch.tensor([ids], device=dev),
                                        position_ids=torch.tensor([pos], device=dev), **kwargs).logits[0]
            finally:
                if token is not None:
                    RowPlan.done(token)
        held = self.device_bytes()
        self.counters["peak_device_bytes"] = max(self.counters["peak_device_bytes"], held + self._unstage(batch))
        if self.config.kv_budget is not None and held > self.config.kv_budget:
            self.counters["over_budget_steps"] += 1
        registered = False
        for r, toks, is_chunk, _ in batch:
            r.n_cached += len(toks)
            if is_chunk:
                self.counters["computed_prompt_tokens"] += len(toks)
                if self.prefix is not None and r.n_cached % self.config.chunk_tokens == 0 \
                        and r.n_cached < len(r.prompt_ids):
                    self.prefix.register(r.prompt_ids, r.n_cached, r.cache)
                    registered = True
        if registered and self.config.kv_budget is not None:  # snapshots live in the budget's free part
            protect = self._wanted()
            while self.device_bytes() > self.config.kv_budget and self.prefix.evict(protect):
                pass
        if samplers:
            for row, r in zip(logits[:len(samplers)].float(), samplers, strict=True):
                self._accept(r, sample(row, r.params, r.generator))

    def _accept(self, r: Request, token: int) -> None:
        now = time.perf_counter()
        if r.t_first is None:
            r.t_first = now
        r.t_last = now
        r.output_ids.append(token)
        self.counters["output_tokens"] += 1
        p = r.params
        stops = p.stop_token_ids if p.stop_token_ids is not None else ([] if p.ignore_eos else self._eos)
        if token in stops:
            self.running.remove(r)
            self._finish(r, "stop", token, text_delta(self.tok, r, final=True, drop_last=True))
            return
        prev = r.emitted
        delta, cut = text_delta(self.tok, r), None
        if p.stop and self.tok is not None:
            for s in p.stop:  # the earliest stop string in the text not reported before
                i = r.text.find(s, max(0, prev - len(s) + 1))
                if i >= 0 and (cut is None or i < cut):
                    cut = i
        if cut is not None:
            r.text, r.emitted = r.text[:cut], min(prev, cut)
            self.running.remove(r)
            self._finish(r, "stop", token, text_delta(self.tok, r, final=True, recompute=False))
            return
        if len(r.output_ids) >= p.max_tokens:
            self.running.remove(r)
            self._finish(r, "length", token, delta + text_delta(self.tok, r, final=True, recompute=False))
            return
        self._emit(r, TokenEvent(r.id, token, delta))

    # ---- running ------------------------------------------------------------------------
    def start(self) -> None:
        """Step in a background thread whenever there is work (until :meth:`stop`).

        A compute thread that is not the one the model was loaded on gets an OpenMP
        thread team of its own beside the first one; with more OpenMP threads than cores
        the runtime stops spinning between parallel regions, and a decode step of many
        small ops waits on sleeping threads at every op. Where that matters, step on the loading
        thread with :meth:`serve_forever` and put the other work (an HTTP server) on a
        thread instead, as ``lessmem serve`` does."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self.serve_forever, name="lessmem-engine", daemon=True)
        self._thread.start()

    def serve_forever(self, until=None) -> None:
        """Step in the calling thread whenever there is work, until :meth:`stop` or until
        ``until()`` (checked between steps and at least every 0.1 s when idle) is true."""
        while True:
            with self._lock:
                while not self._stop and not (until is not None and until()) \
                        and not (self.waiting or self.running or self.swapped or self._aborts):
                    self._lock.wait(0.1)
                if self._stop or (until is not None and until()):
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 (fail the step's requests, keep serving)
                warnings.warn(f"engine step failed: {e!r}; its requests are aborted", RuntimeWarning,
                              stacklevel=2)
                for r in list(self.running):
                    self.running.remove(r)
                    self._finish(r, "abort")

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def generate_many(self, prompts, params: SamplingParams | None = None, progress: bool = True) -> list[Request]:
        """Run a batch of prompts (strings need the tokenizer, or token id lists) to the
        end; returns the requests in order. ``progress``: a line per finished request on stderr."""
        params = params or SamplingParams()
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tok is None:
                    raise ValueError("string prompts need the engine's tokenizer; allowed: token id lists")
                p = self.tok(p).input_ids
            ids.append(self.check_request(p, params)[0])
        reqs = [self.submit(p, params) for p in ids]
        t0, done = time.perf_counter(), 0
        while any(not r.done.is_set() for r in reqs):
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.05)
            n = sum(r.done.is_set() for r in reqs)
            if progress and n > done:
                done = n
                toks = sum(len(r.output_ids) for r in reqs)
                print(f"generate_many: {done}/{len(reqs)} done, {toks} tokens, "
                      f"{toks / (time.perf_counter() - t0):.1f} tok/s", file=sys.stderr, flush=True)
        return reqs

    def metrics(self) -> dict:
        """What the engine holds and has done (see :mod:`lessmem.serve`). Safe from any
        thread and never blocks: while a step is in progress it returns the figures as
        they were after the last step (a server's event loop must not wait on a step)."""
        if not self._step_lock.acquire(blocking=False):
            return dict(self._last_metrics) if self._last_metrics else {}
        try:
            self._last_metrics = self._metrics()
            return dict(self._last_metrics)
        finally:
            self._step_lock.release()

    def _metrics(self) -> dict:
        by_tier = {"device": self.device_bytes(), "host": 0, "disk": 0, "redis": 0}
        for t in self.tiers:
            name = next((n for n, c in _TIER_KINDS if isinstance(t, c)), t.name)
            try:
                by_tier[name] = by_tier.get(name, 0) + int(t.nbytes)
            except (TierUnavailableError, OSError):  # an unreachable tier reports nothing
                pass
        fmt = {"codes": 0, "scales": 0, "zero_points": 0, "window": 0, "sinks": 0,
               "k_quant_bytes": 0, "v_quant_bytes": 0}
        for name, b in self.pool.part_bytes.items():
            count_part(fmt, name, b)
        del fmt["k_quant_bytes"], fmt["v_quant_bytes"]
        for r in self.running:
            if r.cache is None:
                continue
            for layer in r.cache.paged_layers():
                if not layer.is_initialized:
                    continue
                sinks = sum(map(tensor_bytes, layer.sinks or ())) if layer.quantized else 0
                fmt["sinks"] += sinks
                fmt["window"] += layer.fp_bytes() - sinks  # (the window's buffer, as budgeted)
        with self._lock:
            waiting, swapped = len(self.waiting), len(self.swapped)
        pc = self.prefix
        return dict(running=len(self.running), waiting=waiting, swapped=swapped,
                    kv_budget=self.config.kv_budget, kv_bytes_by_tier=by_tier, kv_bytes_by_format=fmt,
                    prefix_bytes=pc.fp_bytes if pc else 0, prefix_entries=len(pc.entries) if pc else 0,
                    prefix_queries=pc.queries if pc else 0, prefix_hits=pc.hits if pc else 0,
                    prefix_tokens_reused=pc.tokens_reused if pc else 0,
                    prefix_tier_hits=pc.tier_hits if pc else 0,
                    finished_by_reason=dict(self.finished_by_reason), **self.counters)

    def close(self) -> None:
        """Stop, free every request and snapshot, close the tiers, restore the model."""
        self.stop()
        for q in (self.waiting, self.swapped, self.running):
            for r in list(q):
                q.remove(r)
                self._finish(r, "abort")
        if self.prefix is not None:
            self.prefix.clear()
        for t in self.tiers:
            try:
                t.close()
            except Exception:  # noqa: BLE001
                pass
        if self._plan is not None:
            self._plan.remove()
        self._switch.disable()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
