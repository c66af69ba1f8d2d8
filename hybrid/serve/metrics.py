"""The server's Prometheus metrics, in a registry of its own per app (so two apps in one process, as in the tests,
count apart): requests by outcome, TTFT / TPOT / end-to-end latency, prompt and generated tokens, the engine's
running and waiting requests, KV slots in use and the prefix cache (hit and queried tokens, blocks per tier,
evictions; read at scrape time), and the engine's step time."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# stop / length: finished; abort: the client left or the shutdown's grace ran out; error: the engine failed it;
# rejected: bad input, unknown model or key (4xx); queue_full: 429; unavailable: 503 (loading, shutting down)
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "queue_full", "unavailable")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hybrid_requests", "Generation requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("hybrid_time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("hybrid_time_per_output_token_seconds", "Mean time between generated tokens, per request",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("hybrid_e2e_request_latency_seconds", "Arrival to the last token", buckets=_LATENCY,
                             registry=r)
        self.prompt_tokens = Counter("hybrid_prompt_tokens", "Prompt tokens of the requests taken", registry=r)
        self.generated_tokens = Counter("hybrid_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("hybrid_requests_running", "Requests holding a KV slot", registry=r)
        self.waiting = Gauge("hybrid_requests_waiting", "Requests queued for a KV slot", registry=r)
        self.kv_slots = Gauge("hybrid_kv_slots_in_use", "KV-cache slots in use", registry=r)
        self.kv_slots_total = Gauge("hybrid_kv_slots_total", "KV-cache slots", registry=r)
        self.step = Histogram("hybrid_engine_step_seconds", "Engine step time (prefill chunks + one decode step)",
                              buckets=_PER_TOKEN + (10.0, 30.0), registry=r)
        self.engine: Optional[object] = None
        r.register(_PrefixCache(self))
        self.bind(None)

    def bind(self, engine: Optional[object]) -> None:
        """Gauges read from the engine at scrape time (0 while none is loaded)."""
        self.engine = engine
        if engine is None:
            for g in (self.running, self.waiting, self.kv_slots, self.kv_slots_total):
                g.set_function(lambda: 0)
            return
        self.running.set_function(lambda: engine.running)
        self.waiting.set_function(lambda: engine.waiting)
        self.kv_slots.set_function(lambda: engine.scheduler.slots_in_use)
        self.kv_slots_total.set_function(lambda: engine.cache.slots)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCache:
    """The engine's KV manager's counters (hybrid/kv/manager.py KVStats), read at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        engine = self.metrics.engine
        kv = getattr(engine, "kv", None)
        if kv is None:
            return
        s = kv.stats()
        for name, doc, value in (
                ("hybrid_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", s.queried_tokens),
                ("hybrid_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", s.hit_tokens),
                ("hybrid_prefix_cache_host_hit_tokens", "... of which copied back from the host tier",
                 s.host_hit_tokens)):
            yield CounterMetricFamily(name, doc, value=value)
        ev = CounterMetricFamily("hybrid_kv_evictions", "Cached KV blocks whose room was reused, by tier",
                                 labels=["tier"])
        ev.add_metric(["device"], s.evictions)
        ev.add_metric(["host"], s.host_evictions)
        yield ev
        blocks = GaugeMetricFamily("hybrid_kv_blocks", "KV blocks by tier and state (in_use: held by a request; "
                                   "cached: a prefix no request holds; total)", labels=["tier", "state"])
        for tier, state, value in (("device", "in_use", s.device_blocks_in_use),
                                   ("device", "cached", s.device_blocks_cached), ("device", "total", s.device_blocks),
                                   ("host", "cached", s.host_blocks_cached), ("host", "total", s.host_blocks)):
            blocks.add_metric([tier, state], value)
        yield blocks
