"""What ``GET /metrics`` of ``lessmem serve`` reports, in the Prometheus text format.

One :class:`ServeMetrics` per app, on its own ``prometheus_client`` registry (two apps
in one process do not mix their series). Two kinds of series:

Read from ``engine.metrics()`` at each scrape (the engine's own numbers); gauges:

- ``lessmem_requests_running`` / ``_waiting`` / ``_swapped``: requests in the running
  batch, queued, and preempted with their blocks in a lower tier;
  ``lessmem_requests_running_peak``: the most that ran at once so far;
- ``lessmem_kv_bytes{tier}``: KV bytes held per tier (device, host, disk, redis);
  ``lessmem_kv_format_bytes{format}``: per part of the stored format (codes, scales,
  zero_points, window, sinks); ``lessmem_kv_budget_bytes`` (absent when unbounded),
  ``lessmem_kv_device_peak_bytes``;
- ``lessmem_prefix_entries``, ``lessmem_prefix_bytes``: prefix snapshots held in memory;

counters (``_total``):

- ``lessmem_requests_finished_total{finish_reason}``: stop, length, abort (a client that
  went away, or the engine closing);
- ``lessmem_prefix_queries_total``, ``lessmem_prefix_hits_total`` (hit rate: their
  ratio), ``lessmem_prefix_tier_hits_total`` (hits read back from the disk/Redis tier: a
  restart or another process wrote them), ``lessmem_prefix_tokens_reused_total``;
- ``lessmem_prompt_tokens_total``, ``lessmem_prompt_tokens_computed_total`` (the rest
  came from the prefix cache), ``lessmem_generation_tokens_total`` (tokens/s: its
  ``rate()``);
- ``lessmem_preemptions_total``, ``lessmem_recomputes_total``,
  ``lessmem_kv_pages_demoted_total``, ``lessmem_over_budget_steps_total``,
  ``lessmem_engine_steps_total``, ``lessmem_engine_lean_steps_total`` (steps of decode rows
  only that skipped transformers' forward: ``LeanDecode.serve_step``),
  ``lessmem_engine_step_seconds_total``.

Counted by the server: ``lessmem_requests_accepted_total``,
``lessmem_requests_rejected_total{status}`` (refused with an HTTP error), and the
histograms ``lessmem_time_to_first_token_seconds`` (arrival to first token),
``lessmem_time_per_output_token_seconds`` (a request's mean gap between later tokens)
and ``lessmem_request_latency_seconds`` (arrival to the last event).

Example:
    >>> from lessmem.models import tiny_random
    >>> from lessmem.serve import Engine, EngineConfig, SamplingParams
    >>> engine = Engine(tiny_random("llama"), None, EngineConfig(kv="int4"))
    >>> m = ServeMetrics(engine)
    >>> req = engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0))
    >>> while engine.step():
    ...     pass
    >>> m.observe_finished(req.stats, 0.5)
    >>> text = m.render().decode()
    >>> 'lessmem_requests_finished_total{finish_reason="length"} 1.0' in text
    True
    >>> "lessmem_generation_tokens_total 3.0" in text, "lessmem_time_to_first_token_seconds_count 1.0" in text
    (True, True)
    >>> engine.close()
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# (series name, engine.metrics() key, help); keys the engine does not report are left out
_GAUGES = (("requests_running", "running", "requests in the running batch"),
           ("requests_waiting", "waiting", "requests queued, not admitted yet"),
           ("requests_swapped", "swapped", "preempted requests whose blocks wait in a lower tier"),
           ("requests_running_peak", "max_running", "most requests running at once so far"),
           ("kv_budget_bytes", "kv_budget", "the device KV budget of all requests together"),
           ("kv_device_peak_bytes", "peak_device_bytes", "most device KV bytes held in one step"),
           ("prefix_entries", "prefix_entries", "prefix snapshots held in memory"),
           ("prefix_bytes", "prefix_bytes", "full-precision bytes of the prefix snapshots"))
_COUNTERS = (("prefix_queries", "prefix_queries", "prefix-cache look-ups"),
             ("prefix_hits", "prefix_hits", "prefix-cache look-ups that found a stored prefix"),
             ("prefix_tier_hits", "prefix_tier_hits",
              "prefix hits read from the persistent tier (a restart or another process wrote them)"),
             ("prefix_tokens_reused", "prefix_tokens_reused", "prompt tokens whose KV came from the prefix cache"),
             ("prompt_tokens", "prompt_tokens", "prompt tokens taken in"),
             ("prompt_tokens_computed", "computed_prompt_tokens", "prompt tokens prefilled"),
             ("generation_tokens", "output_tokens", "tokens generated"),
             ("preemptions", "preemptions", "requests preempted (swapped out or dropped for recompute)"),
             ("recomputes", "recomputes", "requests whose KV was dropped and computed again"),
             ("kv_pages_demoted", "demoted_pages", "device KV pages moved to a lower tier"),
             ("over_budget_steps", "over_budget_steps", "steps that ended above the KV budget"),
             ("engine_steps", "steps", "engine scheduler steps"),
             ("engine_lean_steps", "lean_steps", "engine steps of decode rows only that took the lean decode step"),
             ("engine_step_seconds", "step_seconds", "seconds spent in engine steps"))


class _EngineCollector:
    """The engine's numbers, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # not known before the first scrape (no call into the engine at registration)

    def collect(self):
        m = self.engine.metrics()
        for name, key, doc in _GAUGES:
            if m.get(key) is not None:
                yield GaugeMetricFamily(f"lessmem_{name}", doc, value=m[key])
        for name, key, label, doc in (("kv_bytes", "kv_bytes_by_tier", "tier", "KV cache bytes held per tier"),
                                      ("kv_format_bytes", "kv_bytes_by_format", "format",
                                       "KV cache bytes per part of the stored format")):
            g = GaugeMetricFamily(f"lessmem_{name}", doc, labels=[label])
            for k, n in m[key].items():
                g.add_metric([k], n)
            yield g
        fin = CounterMetricFamily("lessmem_requests_finished", "requests finished, by finish reason",
                                  labels=["finish_reason"])
        for reason, n in {**dict.fromkeys(FINISH_REASONS, 0), **m["finished_by_reason"]}.items():
            fin.add_metric([reason], n)
        yield fin
        for name, key, doc in _COUNTERS:
            if m.get(key) is not None:
                yield CounterMetricFamily(f"lessmem_{name}", doc, value=m[key])


class ServeMetrics:
    """The registry behind ``/metrics``: the engine's numbers plus the server's own."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self._accepted = Counter("lessmem_requests_accepted", "requests queued in the engine", registry=r)
        self._rejected = Counter("lessmem_requests_rejected", "requests refused with an HTTP error, by status",
                                 ["status"], registry=r)
        self.ttft = Histogram("lessmem_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("lessmem_time_per_output_token_seconds",
                              "mean time between output tokens after the first, per request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram("lessmem_request_latency_seconds", "time from arrival to the last event",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def accepted(self) -> None:
        self._accepted.inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(str(status)).inc()

    def observe_finished(self, stats: dict, latency_s: float) -> None:
        """One finished request: its TTFT/TPOT from the engine's ``req.stats``, its latency."""
        self.latency.observe(max(latency_s, 0.0))
        ttft, tpot = stats.get("ttft_s"), stats.get("tpot_s")
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None and (stats.get("output_tokens") or 0) > 1:
            self.tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
