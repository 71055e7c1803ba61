"""Serving many requests under one KV budget: ``lessmem serve`` and its engine.

- :mod:`.engine`: :class:`Engine` (continuous batching, chunked prefill, admission by
  free KV bytes, preemption by swap or recompute), :class:`EngineConfig`,
  :class:`SamplingParams`, :class:`Request`, :class:`TokenEvent`;
- :mod:`.paged`: each request's quantized KV as refcounted pages in one pool;
- :mod:`.batch`: one forward pass over the packed, ragged tokens of a step;
- :mod:`.prefix`: prefix snapshots shared by reference, persisted to a disk/Redis tier;
- :mod:`.server`: the OpenAI-compatible HTTP server (``lessmem serve``).
"""

from .engine import Engine, EngineConfig, Request, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams", "TokenEvent"]
