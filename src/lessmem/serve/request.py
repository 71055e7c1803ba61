"""A request as the engine tracks it, and the events its listener receives."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .paged import PagedKVCache


@dataclass
class TokenEvent:
    """One new token of a request (``token_id``), or its end (``finished``)."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class Request:
    """A request as the engine tracks it; read ``output_ids``, ``text``, ``finish_reason``
    and ``stats`` after ``done`` is set."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    listener: object = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    state: str = "waiting"
    cache: PagedKVCache | None = None
    n_cached: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    swap_key: str | None = None
    emitted: int = 0
    order: int = 0
    generator: torch.Generator | None = None
    hashes: list[str] | None = None  # chained hash of each whole prompt chunk (prefix cache)

    @property
    def stats(self) -> dict:
        n = len(self.output_ids)
        return dict(prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached_tokens,
                    output_tokens=n, preemptions=self.preemptions,
                    ttft_s=None if self.t_first is None else self.t_first - self.arrival,
                    tpot_s=(self.t_last - self.t_first) / (n - 1) if n > 1 else None)
