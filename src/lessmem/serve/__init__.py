"""Serving many requests under one KV budget: ``lessmem serve`` and its engine.

- :mod:`.engine`: :class:`Engine` (continuous batching, chunked prefill, admission by
  free KV bytes, preemption by swap or recompute);
- :mod:`.config`: :class:`EngineConfig`, :class:`SamplingParams`; :mod:`.request`:
  :class:`Request`, :class:`TokenEvent`; :mod:`.text`: sampling and streamed text;
- :mod:`.paged`: each request's quantized KV as refcounted pages in one pool;
- :mod:`.batch`: one forward pass over the packed, ragged tokens of a step;
- :mod:`.prefix`: prefix snapshots shared by reference, persisted to a disk/Redis tier;
- :mod:`.server`: the OpenAI-compatible HTTP server (``lessmem serve``).
"""

from .config import EngineConfig, SamplingParams
from .engine import Engine
from .request import Request, TokenEvent

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams", "TokenEvent"]
