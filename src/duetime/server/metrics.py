"""Prometheus metrics of one server, in their own registry (so tests can run several).

Gauges, and the engine's step and error counters, are read from the engine's latest
:class:`EngineStats` when scraped; the other counters and histograms are fed by every
request's outcome, and
:class:`ResponseCounter` counts every HTTP response by route and status, so the
4xx a client caused (refused before it became a request) show up too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duetime.server.loop_outcomes import EngineStats
from duetime.server.streams import Outcome

__all__ = ["ResponseCounter", "ServerMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


#: (finished answers in the served-length window, the share of them max_tokens cut)
LengthSummary = Callable[[], tuple[int, float | None] | None]


class _EngineCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        hits: Callable[[], float | None],
        lengths: LengthSummary,
    ) -> None:
        self._stats = stats
        self._hits = hits
        self._lengths = lengths

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        for name, doc, value in (
            ("duetime_queue_length", "Requests waiting for the engine.", s.waiting),
            ("duetime_running", "Sequences in the running batch.", s.running),
            ("duetime_suspended", "Sequences suspended or swapped out.", s.suspended),
            ("duetime_kv_used_tokens", "KV cache memory in use, in tokens.", s.kv_used),
            ("duetime_kv_capacity_tokens", "KV cache budget M, in tokens.", s.kv_capacity),
            (
                "duetime_prefix_cache_tokens",
                "Prompt KV the prefix cache holds, in tokens (off the KV budget).",
                s.prefix_cache_tokens,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        # counters (they only grow: a scraper's rate() reads them), exposed as *_total
        yield CounterMetricFamily("duetime_engine_steps", "Engine steps run.", s.engine_steps)
        yield CounterMetricFamily(
            "duetime_engine_errors", "Steps that raised (the engine restarted).", s.engine_errors
        )
        rate = self._hits()
        if rate is not None:
            yield GaugeMetricFamily(
                "duetime_deadline_hit_rate",
                "Fraction of requests with a deadline that met it.",
                value=rate,
            )
        lengths = self._lengths()
        if lengths is not None:
            answers, cut = lengths
            yield GaugeMetricFamily(
                "duetime_served_length_answers",
                "Finished answers the length predictor is corrected by (--length-window).",
                value=answers,
            )
            if cut is not None:
                yield GaugeMetricFamily(
                    "duetime_served_length_cut_ratio",
                    "Share of those answers that max_tokens cut (the model did not end them).",
                    value=cut,
                )


class ServerMetrics:
    def __init__(
        self, stats: Callable[[], EngineStats], lengths: LengthSummary = lambda: None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "duetime_requests", "Finished requests by finish reason.", ["reason"], registry=r
        )
        self.rejected = Counter(
            "duetime_rejected",
            "Requests refused with 429 by admission control.",
            ["why"],
            registry=r,
        )
        self.deadlines = Counter(
            "duetime_deadlines",
            "Requests with a deadline, by whether they met it.",
            ["met"],
            registry=r,
        )
        self.ttft = Histogram(
            "duetime_ttft_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "duetime_e2e_seconds",
            "Request end-to-end latency.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("duetime_generated_tokens", "Tokens generated.", registry=r)
        self.prefix_queries = Counter(
            "duetime_prefix_cache_queries",
            "Prompt tokens of requests admitted to the engine (looked up in the prefix cache).",
            registry=r,
        )
        self.prefix_hits = Counter(
            "duetime_prefix_cache_hits",
            "Prompt tokens whose KV the prefix cache supplied.",
            registry=r,
        )
        self.responses = Counter(
            "duetime_http_responses",
            "HTTP responses by route and status (a stream's status is its first line's).",
            ["route", "status"],
            registry=r,
        )
        self._met = 0
        self._with_deadline = 0
        # Outcomes are observed on the event loop (answers read) and on the engine thread
        # (outcomes of clients that left): the two counts behind the hit rate move together.
        self._lock = threading.Lock()
        r.register(_EngineCollector(stats, self.hit_rate, lengths))

    def hit_rate(self) -> float | None:
        with self._lock:
            return self._met / self._with_deadline if self._with_deadline else None

    def observe(self, outcome: Outcome) -> None:
        self.requests.labels(outcome.finish_reason).inc()
        self.tokens.inc(outcome.output_tokens)
        if outcome.cached_tokens is not None:
            self.prefix_queries.inc(outcome.prompt_tokens)
            self.prefix_hits.inc(outcome.cached_tokens)
        if outcome.ttft is not None:
            self.ttft.observe(outcome.ttft)
        if outcome.finish_reason in ("stop", "length"):
            self.e2e.observe(outcome.e2e)
        met = outcome.deadline_met
        if met is not None:
            with self._lock:
                self._with_deadline += 1
                self._met += int(met)
            self.deadlines.labels(str(met).lower()).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ResponseCounter:
    """ASGI middleware: counts each HTTP response's status into ``metrics.responses``.

    It sits outside the body-size guard, so a body refused with 413 before the app
    parsed it counts too; an exception no handler took is counted as the 500
    Starlette's outermost layer then sends. Paths other than ``routes`` share the
    label "other" (a scanner's random paths must not grow the metric without bound).
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"

        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responses.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self.metrics.responses.labels(route, "500").inc()
            raise
