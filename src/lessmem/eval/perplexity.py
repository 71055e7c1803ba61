"""The evaluation protocol: perplexity, KLD and top-1 agreement of KV caches.

Protocol (fixed, reproducible):

1. The text is tokenized without special tokens and cut into consecutive,
   non-overlapping windows of ``window_len`` tokens; the first ``windows`` are used.
2. Warm-up (``warmup=True``, the default): before anything is timed, each config runs
   a prefill and one chunk on a throwaway cache, so the first use of its kernels
   (building or loading them, first allocations) is not counted in its speed; that
   one-time cost is reported on its own as ``first_use_s`` (the warm-up's time less a
   warm prefill and chunk).
3. For each window and each config a fresh cache is built; the first
   ``P = window_len // 4`` tokens are prefilled through it in one forward pass;
   the remaining tokens are fed through the same cache in chunks of ``chunk`` tokens
   (``chunk=1`` is exact token-by-token decoding). GGUF linears held as blocks multiply
   float32 activations throughout (their int8-activation decode path is switched off
   for the run), so every config differs from the baseline by its cache alone.
4. Every token after the prefill is scored (``window_len - P`` per window): token
   ``P`` from the prefill's last logits, tokens ``P+1..N-1`` from the chunks' logits.
5. The unquantized baseline (transformers ``DynamicCache``) runs in lockstep with the
   configs, chunk by chunk, so its next-token distribution ``p`` is held for one chunk
   only (``[chunk, vocab]``), never for the whole text. Per config with distribution
   ``q``::

       ppl    = exp(mean_t  -log q_t(x_t))
       kld    = mean_t  sum_v p_t(v) (log p_t(v) - log q_t(v))      # KL(p || q), nats
       top1   = mean_t  [argmax q_t == argmax p_t]
       delta_ppl_pct = 100 (ppl / ppl_baseline - 1)

6. Bytes are read from the cache after the whole window (``window_len`` tokens held);
   ``tok_per_s`` is tokens fed in the chunk phase / seconds spent in those forwards.

Example:
    >>> from lessmem.models import tiny_random, tiny_tokenizer
    >>> rows = evaluate(tiny_random(), tiny_tokenizer(), ["dynamic"], "hello world " * 40,
    ...                 windows=2, window_len=64, chunk=8)
    >>> rows[0]["config"], rows[0]["delta_ppl_pct"], rows[0]["kld"]
    ('dynamic', 0.0, 0.0)
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch

from lessmem.eval.caches import (
    BASELINE,
    CacheSpec,
    cache_kwarg,
    close_cache,
    measure_memory,
    resolve_configs,
)

MIN_WINDOW_LEN = 8


def check_protocol(windows: int, window_len: int, chunk: int) -> None:
    """ValueError naming the bad protocol value and what is allowed."""
    for name, v, lo in (("windows", windows, 1), ("window_len", window_len, MIN_WINDOW_LEN), ("chunk", chunk, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}; allowed: an integer >= {lo}")


def make_windows(tok, text, windows: int, window_len: int) -> torch.Tensor:
    """``[windows, window_len]`` token ids: consecutive windows from the text's start.

    ``text`` is a string (tokenized without special tokens, only as much as needed)
    or a 1-D tensor of token ids.

    Example:
        >>> from lessmem.models import tiny_tokenizer
        >>> make_windows(tiny_tokenizer(), "abcdefghij" * 4, 2, 16).shape
        torch.Size([2, 16])
    """
    check_protocol(windows, window_len, 1)
    need = windows * window_len
    if isinstance(text, torch.Tensor):
        ids = text.reshape(-1).long()
    else:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string or a 1-D tensor of token ids, got {type(text).__name__}")
        n_chars = max(need * 8, 4096)  # most tokenizers average < 8 chars per token
        while True:
            ids = torch.tensor(tok(text[:n_chars], add_special_tokens=False)["input_ids"], dtype=torch.long)
            # a margin, so the cut through the text cannot change the tokens we keep
            if ids.numel() > need + 64 or n_chars >= len(text):
                break
            n_chars *= 2
    if ids.numel() < need:
        raise ValueError(
            f"the text has {ids.numel()} tokens; windows={windows} x window_len={window_len} needs "
            f"{need}; use fewer or shorter windows or a longer text"
        )
    return ids[:need].reshape(windows, window_len)


class _Acc:
    """Running sums for one config (float64 on CPU)."""

    def __init__(self):
        self.nll = self.kld = 0.0
        self.top1 = self.n = 0
        self.fed = 0
        self.seconds = 0.0  # chunk forwards (tok_per_s)
        self.chunks = 0
        self.prefill_seconds = 0.0
        self.prefills = 0
        self.warmup_seconds: float | None = None  # prefill + first chunk of the warm-up
        self.mem: list[dict] = []

    def add(self, logits, base: _Baseline, targets):
        # logits [T, V] of this config; targets [T]
        logq = base.logp if logits is base.logits else torch.log_softmax(logits.double(), dim=-1)
        self.nll -= float(logq.gather(-1, targets[:, None]).sum())
        self.kld += float((base.p * (base.logp - logq)).sum(-1).clamp_min(0).sum())
        self.top1 += int((logq.argmax(-1) == base.top).sum())
        self.n += targets.numel()

    def first_use_s(self) -> float:
        """The one-time cost the warm-up paid: its prefill + first chunk, less what a
        prefill and a chunk cost once warm (NaN without a warm-up)."""
        if self.warmup_seconds is None or not self.prefills or not self.chunks:
            return float("nan")
        steady = self.prefill_seconds / self.prefills + self.seconds / self.chunks
        return max(0.0, self.warmup_seconds - steady)


class _Baseline:
    """The baseline's next-token distribution for one step, computed once for every config:
    log-probs in float64 (so small KLDs do not drown in float32 rounding), probs, top-1."""

    def __init__(self, logits):
        self.logits = logits  # [T, V]
        self.logp = torch.log_softmax(logits.double(), dim=-1)
        self.p = self.logp.exp()
        self.top = self.logp.argmax(-1)


def _mean_mem(mems: list[dict]) -> dict:
    keys = [k for k, v in mems[0].items() if isinstance(v, (int, float))]
    return {k: sum(m[k] for m in mems) / len(mems) for k in keys}


@torch.inference_mode()
def evaluate(
    model,
    tok,
    configs,
    text,
    windows: int = 4,
    window_len: int = 1024,
    chunk: int = 16,
    *,
    progress: Callable[[int, int], None] | None = None,
    model_name: str | None = None,
    text_name: str | None = None,
    time_budget_s: float | None = None,
    warmup: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Run the protocol (module docstring) for each config; one result dict per config.

    ``configs``: names (``"dynamic"``, peers, lessmem presets), KVConfigs or
    CacheSpecs; the ``"dynamic"`` baseline is always evaluated and comes first.
    ``progress(done, total)`` is called after every forward step of every window;
    ``log(message)`` once per stage (each config's warm-up, each window).
    ``time_budget_s``: stop after the window during which the budget ran out (at least
    one window is always done); the rows then report the windows actually evaluated.
    ``warmup``: before any timing, run each config once on a throwaway cache (step 2 of
    the protocol), so no config pays the kernels' first use inside ``tok_per_s``.
    Each dict carries ``config, kind, ppl, delta_ppl_pct, kld, top1, k_bits, v_bits,
    kv_bytes, fp16_kv_bytes, compression, tok_per_s, speed_vs_baseline, first_use_s,
    tokens_scored, memory`` and the protocol (``model, text, windows, window_len, chunk,
    prefill, warmup``); rows of tiered caches (``eval.caches.with_offload``) also carry
    ``offload``: bytes per tier, device bytes and peak vs budget. Every cache is closed
    after its window.

    Example:
        >>> from lessmem.models import tiny_random, tiny_tokenizer
        >>> r = evaluate(tiny_random(), tiny_tokenizer(), [], "abc " * 50, 1, 32, 4)
        >>> r[0]["tokens_scored"], r[0]["prefill"], r[0]["top1"]
        (24, 8, 1.0)
    """
    # lessmem caches attend through the fused kernel over their quantized blocks (never
    # inflating the history); other caches still go through SDPA. Undone on return.
    from lessmem.kvcache import enable

    check_protocol(windows, window_len, chunk)
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup={warmup!r}; allowed: True or False")
    specs = _baseline_first(resolve_configs(configs))
    ids_all = make_windows(tok, text, windows, window_len)
    with enable(model), _float_activations(model):
        run = _Lockstep(model, specs, window_len, chunk, progress, log)
        if warmup:
            run.warm_up(ids_all[:1])
        n_done = run.windows(ids_all, time_budget_s)
    protocol = {
        "model": model_name or getattr(model.config, "_name_or_path", None) or type(model).__name__,
        "text": text_name or ("<ids>" if isinstance(text, torch.Tensor) else "<string>"),
        "windows": n_done, "window_len": window_len, "chunk": chunk, "prefill": run.P,
        "warmup": bool(warmup),
    }
    return _rows(specs, run.accs, protocol)


@contextlib.contextmanager
def _float_activations(model):
    """GGUF linears multiply float32 activations while the protocol runs (undone after):
    int8 activations (``GGUFLinear.int8_activations``, on by default for decode rows of a
    GGUF loaded as blocks) round each block of x to a 1/127 grid, so any small change the
    cache makes to a layer's input flips some roundings and the rows differ by that
    rounding, whatever the cache; the protocol measures the cache, against the baseline,
    with the same weights and float activations for every config."""
    from lessmem.weights.gguf_linear import GGUFLinear

    q8 = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.int8_activations]
    for m in q8:
        m.int8_activations = False
    try:
        yield
    finally:
        for m in q8:
            m.int8_activations = True


def _baseline_first(specs: list[CacheSpec]) -> list[CacheSpec]:
    base = [s for s in specs if s.name == BASELINE] or resolve_configs([BASELINE])
    return base + [s for s in specs if s.name != BASELINE]


class _Lockstep:
    """Steps 2 to 6 of the protocol: every config fed the same tokens, chunk by chunk,
    beside the baseline (``specs[0]``)."""

    def __init__(self, model, specs, window_len, chunk, progress, log):
        self.model, self.specs, self.chunk = model, specs, chunk
        self.window_len, self.P = window_len, window_len // 4
        self.kw = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.accs = {s.name: _Acc() for s in specs}
        self.starts = list(range(self.P, window_len, chunk))
        self.progress, self.log = progress, log or (lambda msg: None)

    def _forward(self, x, cache, **kw):
        return self.model(x, **{self.kw: cache}, use_cache=True, **kw)

    def warm_up(self, ids) -> None:
        """Step 2: a prefill and one chunk per config on a throwaway cache, timed apart
        (``first_use_s``): the first use of a kernel (building, loading, first
        allocations) is paid here, not inside any config's tok/s."""
        ids = ids.to(self.device)
        x = ids[:, self.P : self.P + self.chunk]
        for i, s in enumerate(self.specs):
            self.log(f"warm-up {s.name} ({i + 1}/{len(self.specs)})")
            cache = s.make(self.model.config, model=self.model)
            t0 = time.perf_counter()
            self._forward(ids[:, : self.P], cache, logits_to_keep=1)
            self._forward(x, cache)
            self.accs[s.name].warmup_seconds = time.perf_counter() - t0
            close_cache(cache)

    def windows(self, ids_all, time_budget_s) -> int:
        """Steps 3 to 6 over each window; the number of windows evaluated."""
        n = ids_all.shape[0]
        total, t_start, n_done = n * (1 + len(self.starts)), time.perf_counter(), 0
        for w in range(n):
            if time_budget_s is not None and n_done and time.perf_counter() - t_start > time_budget_s:
                break
            self.log(f"window {w + 1}/{n}: {self.window_len} tokens through {len(self.specs)} caches")
            ids = ids_all[w : w + 1].to(self.device)  # [1, N]
            caches = {s.name: s.make(self.model.config, model=self.model) for s in self.specs}
            try:
                self._prefill(ids, caches)
                self._tick(w, 0, total)
                for j, st in enumerate(self.starts):
                    self._step(ids, caches, st)
                    self._tick(w, j + 1, total)
                for s in self.specs:
                    self.accs[s.name].mem.append(measure_memory(caches[s.name]))
            finally:
                for c in caches.values():
                    close_cache(c)
            n_done += 1
        return n_done

    def _tick(self, w, j, total):
        if self.progress:
            self.progress(w * (1 + len(self.starts)) + j + 1, total)

    def _prefill(self, ids, caches) -> None:
        """Step 3, prefill: the last logits of the first P tokens predict token P."""
        base = None
        for s in self.specs:
            acc = self.accs[s.name]
            t0 = time.perf_counter()
            out = self._forward(ids[:, : self.P], caches[s.name], logits_to_keep=1)
            acc.prefill_seconds += time.perf_counter() - t0
            acc.prefills += 1
            logits = out.logits[0, -1:]  # [1, V]
            base = base or _Baseline(logits)
            acc.add(logits, base, ids[0, self.P : self.P + 1])

    def _step(self, ids, caches, st) -> None:
        """Steps 3-5, one chunk: tokens st..en-1 fed, tokens st+1..en scored."""
        en = min(st + self.chunk, self.window_len)
        x = ids[:, st:en]  # [1, c]
        targets = ids[0, st + 1 : en + 1]  # the last chunk's last logit has no target
        n_t = targets.numel()
        base = None
        for s in self.specs:
            acc = self.accs[s.name]
            t0 = time.perf_counter()
            out = self._forward(x, caches[s.name])
            acc.seconds += time.perf_counter() - t0
            acc.fed += x.shape[1]
            acc.chunks += 1
            if n_t == 0:
                continue
            logits = out.logits[0, :n_t]  # [n_t, V]
            base = base or _Baseline(logits)
            acc.add(logits, base, targets)


def _rows(specs: list[CacheSpec], accs: dict, protocol: dict) -> list[dict]:
    rows = []
    b = accs[specs[0].name]
    base_ppl = math.exp(b.nll / b.n)
    base_tps = b.fed / b.seconds if b.seconds > 0 else float("nan")
    for s in specs:
        a = accs[s.name]
        mem = _mean_mem(a.mem)
        ppl = math.exp(a.nll / a.n)
        tps = a.fed / a.seconds if a.seconds > 0 else float("nan")
        kv, fp16 = int(round(mem["total"])), int(round(mem.get("fp16_equivalent", 0)))
        # bits over quantized tokens; with nothing quantized (0), the bits of what is held
        all_bits = 16.0 * kv / fp16 if fp16 else float("nan")
        k_bits = float(mem.get("k_bits", float("nan"))) or all_bits
        v_bits = float(mem.get("v_bits", float("nan"))) or all_bits
        rows.append({
            "config": s.name,
            "kind": s.kind,
            "ppl": ppl,
            "delta_ppl_pct": 100.0 * (ppl / base_ppl - 1.0),
            "kld": a.kld / a.n,
            "top1": a.top1 / a.n,
            "k_bits": k_bits,
            "v_bits": v_bits,
            "kv_bytes": kv,
            "fp16_kv_bytes": fp16,
            "compression": fp16 / kv if kv else float("nan"),
            "tok_per_s": tps,
            "speed_vs_baseline": tps / base_tps if base_tps == base_tps and base_tps > 0 else float("nan"),
            "first_use_s": a.first_use_s(),
            "tokens_scored": a.n,
            "memory": mem,
            "detail": s.detail,
            **protocol,
        })
        _add_offload(rows[-1], a.mem)
    return rows


def _add_offload(row: dict, mems: list[dict]) -> None:
    """For a tiered cache, ``row["offload"]``: where its bytes were after each window, averaged
    over windows (``tiers``: bytes per tier, ``device_bytes``), the highest ``device_peak`` of
    any window, the ``device_budget``, and ``within_budget`` (peak <= budget, or no budget)."""
    from lessmem.eval.caches import placement

    pls = [p for p in (placement(m) for m in mems) if p is not None]
    if not pls:
        return
    n = len(pls)
    names = list(dict.fromkeys(k for p in pls for k in p["tiers"]))
    budget = pls[0]["device_budget"]
    peak = max(p["device_peak"] for p in pls)
    row["offload"] = {
        "tiers": {k: sum(p["tiers"].get(k, 0) for p in pls) / n for k in names},
        "device_bytes": sum(p["device_bytes"] for p in pls) / n,
        "device_peak": peak,
        "device_budget": budget,
        "within_budget": budget is None or peak <= budget,
        "resident": sum(p["resident"] for p in pls) / n,
    }
