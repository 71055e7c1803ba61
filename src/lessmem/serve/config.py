"""What the serving engine is configured with, checked without a model.

:class:`EngineConfig` (the engine's KV format, budget, tiers, batching limits) and
:class:`SamplingParams` (one request's decoding and stopping rules). Each has a
``check()`` that returns a normalized copy or raises ``ValueError`` naming the field and
what is allowed, so ``lessmem serve`` refuses bad options before the model loads and the
server answers a bad request with a 400 before anything is queued.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ..base.units import parse_bytes
from ..kvcache.config import KVConfig
from ..kvcache.presets import PRESETS, resolve
from ..offload import parse_offload_spec

PREEMPT = ("auto", "swap", "recompute")


def _int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={v!r}; allowed: an integer {rng}")
    return int(v)


def _float(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) \
            or v < lo or v > hi or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ValueError(f"{name}={v!r}; allowed: a number in {rng}")
    return float(v)


def kv_config_for(kv) -> KVConfig:
    """The KV config the engine stores: a preset or a KVConfig; ``"fp16"`` really holds
    fp16 (the preset keeps the model's dtype)."""
    if isinstance(kv, str) and kv == "fp16":
        return replace(PRESETS["fp16"], window_dtype="fp16")
    return resolve(kv)


DEFAULT_STEP_TOKENS = 512


def step_tokens_for(chunk_tokens: int, max_running: int, step_tokens=None) -> int:
    """A step's token limit: ``step_tokens`` checked (at least ``chunk_tokens + max_running``:
    a step takes a decode token of every running request first, then whole prompt chunks),
    or unset, 512 or that sum when it is more. ValueError naming the rule otherwise."""
    least = chunk_tokens + max_running
    if step_tokens is None:
        return max(DEFAULT_STEP_TOKENS, least)
    try:
        return _int("step_tokens", step_tokens, least)
    except ValueError:
        raise ValueError(f"step_tokens={step_tokens!r}; allowed: an integer >= chunk_tokens + max_running = "
                         f"{chunk_tokens} + {max_running} = {least} (a step takes a decode token of every "
                         "running request first, then whole prompt chunks: with less, no prompt is "
                         f"prefilled while requests decode); left unset it is max({DEFAULT_STEP_TOKENS}, "
                         "that sum)") from None


@dataclass
class EngineConfig:
    """What the engine serves with (see the module doc). :meth:`check` validates and
    normalizes it without a model, so a command line can refuse bad input first."""

    kv: str | KVConfig = "best-4"
    kv_budget: int | str | None = None
    offload: str | list | None = None
    max_running: int = 64
    # 512: against 256, bench_serve's best-4 row (16 requests of 1024 + 256 tokens over HTTP,
    # serve_chunk256.json / serve_chunk512.json, same sitting) 60.8 -> 66.9 tok/s, TTFT and TPOT
    # p50 lower too: half as many prompt steps (34 against 67), each decoding the weights and carrying
    # the decode rows once
    chunk_tokens: int = 512
    step_tokens: int | None = None  # None: step_tokens_for(chunk_tokens, max_running)
    preempt: str = "auto"
    prefix_cache: bool = True
    batch_invariant: bool = True

    def check(self) -> EngineConfig:
        kv = kv_config_for(self.kv)
        budget = None if self.kv_budget is None else parse_bytes(self.kv_budget, "kv_budget")
        if budget is not None and budget <= 0:
            raise ValueError(f"kv_budget={self.kv_budget!r}; allowed: a positive size or None (unbounded)")
        specs = parse_offload_spec(self.offload) if isinstance(self.offload, str) else self.offload
        if specs is not None and not isinstance(specs, list):
            raise ValueError(f"offload={self.offload!r}; allowed: None or a tier spec such as "
                             "'host@2GiB,disk:/var/kv'")
        if specs and any(getattr(s, "kind", None) == "device" for s in specs):
            raise ValueError(f"offload={self.offload!r}: the device is the KV budget itself; "
                             "allowed: host, disk and Redis tiers")
        _int("max_running", self.max_running, 1)
        _int("chunk_tokens", self.chunk_tokens, 1)
        if self.chunk_tokens % kv.block_size:
            raise ValueError(f"chunk_tokens={self.chunk_tokens}; allowed: a multiple of the KV "
                             f"config's block_size {kv.block_size}")
        step = step_tokens_for(self.chunk_tokens, self.max_running, self.step_tokens)
        if self.preempt not in PREEMPT:
            raise ValueError(f"preempt={self.preempt!r}; allowed: {', '.join(PREEMPT)}")
        if self.preempt == "swap" and not specs:
            raise ValueError("preempt='swap' needs a lower tier to swap to; allowed: offload= a "
                             "tier spec, or preempt='recompute'/'auto'")
        for name in ("prefix_cache", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: True or False")
        return replace(self, kv=kv, kv_budget=budget, offload=specs or None, step_tokens=step)


@dataclass
class SamplingParams:
    """How a request's tokens are chosen and when it ends. ``temperature=0``: greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def check(self) -> SamplingParams:
        _int("max_tokens", self.max_tokens, 1)
        _float("temperature", self.temperature, 0.0, 100.0)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or
                                 not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop={self.stop!r}; allowed: None, a non-empty string or a list of them")
        if self.seed is not None:
            _int("seed", self.seed, 0, 2 ** 63 - 1)
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}; allowed: None or a list of token ids")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}; allowed: True or False")
        return replace(self, stop=list(stop) if stop else None)
