"""The server's Prometheus metrics (prometheus-client, text format 0.0.4): request, route and
token counters and latency histograms the handler updates, and the engines' live stats read
at scrape time. Each server has its own registry, so several apps can live in one process.

Families (labels): ``megacpp_requests_total`` (endpoint, model, code; 499: the client went
away), ``megacpp_route_total`` (model, how), ``megacpp_prompt_tokens_total`` and
``megacpp_generation_tokens_total`` (model), the engine gauges ``megacpp_engine_running``,
``_waiting``, ``_free_blocks``, ``_total_blocks``, ``_free_slots``, ``_total_slots`` and
``_up``, the prefix cache's gauges ``megacpp_engine_prefix_cache_hit_rate`` (reused / looked-up
prompt tokens since start), ``_prefix_cached_blocks`` and ``_prefix_snapshots``, the engine
counters ``megacpp_engine_preemptions_total``, ``_steps_total``, ``_step_seconds_total``,
``_prefix_cache_queries_total`` (prompt tokens looked up), ``_prefix_cache_hits_total``
(prompt tokens whose caches were reused), ``_prefix_cache_evictions_total`` (cached blocks
handed out again) and ``_spec_draft_tokens_total`` / ``_spec_accepted_tokens_total``
(speculative decoding: their ratio is the acceptance rate) (model), and the histograms
``megacpp_request_duration_seconds``
(endpoint), ``megacpp_time_to_first_token_seconds`` and
``megacpp_inter_token_latency_seconds`` (model).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

# the text format would show each counter's and histogram's creation time as an extra gauge
# family (``*_created``); this server exposes only the families above
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ENGINE_GAUGES = (("running", "Sequences running"), ("waiting", "Requests in the waiting queue"),
                 ("free_blocks", "Free KV blocks"), ("total_blocks", "KV blocks"),
                 ("free_slots", "Free state slots"), ("total_slots", "State slots"),
                 ("prefix_cache_hit_rate", "Prompt tokens reused from the prefix cache / looked up"),
                 ("prefix_cached_blocks", "KV blocks indexed by the prefix cache (held or free)"),
                 ("prefix_snapshots", "M/R state snapshots held by the prefix cache"))


class _EngineStats(Collector):
    """The engines' stats snapshot (refreshed by each engine thread every round), per model."""

    def __init__(self, specialists: Mapping[str, Any]) -> None:
        self.specialists = specialists  # name -> Specialist

    def collect(self) -> Iterator[Metric]:
        engines = {name: spec.engine for name, spec in self.specialists.items()}
        for field, help_ in ENGINE_GAUGES:
            gauge = GaugeMetricFamily(f"megacpp_engine_{field}", help_, labels=["model"])
            for name, engine in engines.items():
                gauge.add_metric([name], getattr(engine.stats, field))
            yield gauge
        for metric, help_, value in (
            ("preemptions", "Sequences preempted (recomputed)", lambda e: e.stats.preemptions),
            ("spec_draft_tokens", "MTP draft tokens verified (speculative decoding)",
             lambda e: e.stats.spec_draft_tokens),
            ("spec_accepted_tokens", "MTP draft tokens accepted (speculative decoding)",
             lambda e: e.stats.spec_accepted_tokens),
            ("steps", "Engine steps run", lambda e: e.steps),
            ("step_seconds", "Time inside engine steps", lambda e: e.step_seconds),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             lambda e: e.stats.prefix_queried_tokens),
            ("prefix_cache_hits", "Prompt tokens whose caches were reused from the prefix cache",
             lambda e: e.stats.prefix_hit_tokens),
            ("prefix_cache_evictions", "Cached KV blocks evicted for new allocations",
             lambda e: e.stats.prefix_evicted_blocks),
        ):
            counter = CounterMetricFamily(f"megacpp_engine_{metric}_total", help_,
                                          labels=["model"])
            for name, engine in engines.items():
                counter.add_metric([name], value(engine))
            yield counter
        up = GaugeMetricFamily("megacpp_engine_up", "1 while the engine thread runs",
                               labels=["model"])
        for name, engine in engines.items():
            up.add_metric([name], int(engine.running))
        yield up


class Metrics:
    """The counters and histograms of one server, and its engines' stats."""

    def __init__(self, specialists: Mapping[str, Any]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "megacpp_requests", "HTTP requests by endpoint, model and status (499: the client "
            "went away)", ["endpoint", "model", "code"], registry=reg)
        self.routes = Counter("megacpp_route", "Requests routed to each specialist, by how",
                              ["model", "how"], registry=reg)
        self.prompt_tokens = Counter("megacpp_prompt_tokens",
                                     "Prompt tokens of finished requests", ["model"], registry=reg)
        self.completion_tokens = Counter("megacpp_generation_tokens", "Completion tokens sent",
                                         ["model"], registry=reg)
        reg.register(_EngineStats(specialists))
        self.latency = Histogram(
            "megacpp_request_duration_seconds", "Request latency, arrival to last byte",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = Histogram(
            "megacpp_time_to_first_token_seconds", "Arrival to the first output token",
            ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(
            "megacpp_inter_token_latency_seconds", "Between consecutive outputs of a request",
            ["model"], buckets=LATENCY_BUCKETS, registry=reg)

    def count_request(self, endpoint: str, model: str, code: int | str) -> None:
        self.requests.labels(endpoint=endpoint, model=model, code=str(code)).inc()

    def count_route(self, model: str, how: str) -> None:
        self.routes.labels(model=model, how=how).inc()

    def add_tokens(self, model: str, prompt: int, completion: int) -> None:
        self.prompt_tokens.labels(model=model).inc(prompt)
        self.completion_tokens.labels(model=model).inc(completion)

    def observe_latency(self, endpoint: str, seconds: float) -> None:
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model=model).observe(seconds)

    def observe_inter_token(self, model: str, seconds: float) -> None:
        self.itl.labels(model=model).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text format (:data:`CONTENT_TYPE`) of every family."""
        return generate_latest(self.registry)
