"""Reading each backend's own ``/metrics`` every ``scrape_interval_s``.

The router's snapshot is only as good as what the gateway knows of each backend;
its own counts miss the backend's queue, its KV use, its prefix cache and every
request other clients send it. So the gateway reads the backend's Prometheus text
(:mod:`.backend_metrics` knows the names ``duetime serve`` and vLLM publish) and
:mod:`.backend_load` moves that picture by what the gateway does between reads.

Failure rules, chosen so that a fleet can start in any order but never runs on a
format the gateway cannot read without saying so:

* at start (:func:`check_metrics`, run by ``duetime gateway`` before it serves),
  a backend whose ``/metrics`` answers text of neither format, or a 4xx, is an
  error naming its URL; one that cannot be reached (refused, timed out, 5xx) is
  a warning: the health probe already keeps it out of rotation until it answers;
* later, a scrape of an unknown format is logged as an error, shown in
  ``/health`` and drops the backend's scraped state at once (the router sees the
  gateway's own counts for it); a scrape that fails to connect keeps the last
  good one until that is older than ``scrape_max_age_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from duetime.server.backend_metrics import MetricsFormatError, parse_metrics
from duetime.server.gateway_poll import BackendPoller
from duetime.server.gateway_pool import Gateway
from duetime.server.gateway_routing import Backend
from duetime.server.gateway_wire import transport_words

__all__ = ["Scraper", "check_metrics"]

log = logging.getLogger("duetime.gateway")


def _refusal(url: str, status: int) -> MetricsFormatError:
    return MetricsFormatError(
        f"{url}/metrics answers HTTP {status}, not Prometheus text; "
        "pass --scrape-interval-ms 0 to route without backend metrics"
    )


def check_metrics(urls: list[str], timeout_s: float = 2.0) -> list[str]:
    """Read each backend's ``/metrics`` once. Raises :class:`MetricsFormatError` (naming
    the URL) for one of neither format; returns a warning for each that cannot be
    reached now (it may come up later)."""
    warnings: list[str] = []
    with httpx.Client(trust_env=False, timeout=timeout_s) as client:
        for url in urls:
            try:
                r = client.get(url + "/metrics")
            except httpx.HTTPError as e:
                warnings.append(
                    f"backend {url}: /metrics not reachable now ({transport_words(e)}); "
                    "its load is read once it answers"
                )
                continue
            if r.status_code >= 500:
                warnings.append(
                    f"backend {url}: /metrics answers HTTP {r.status_code} now; "
                    "its load is read once it answers"
                )
                continue
            if r.status_code != 200:
                raise _refusal(url, r.status_code)
            parse_metrics(r.text, url)
    return warnings


class Scraper(BackendPoller, Collector):
    """Scrapes the gateway's backends and reports how fresh each one's figures are (in
    ``/health``, and as a gauge of the gateway's ``/metrics``, judged when it is read)."""

    def __init__(self, gw: Gateway) -> None:
        super().__init__(gw)
        cfg = gw.config
        self.max_age_s = cfg.scrape_max_age_s
        self.timeout_s = max(0.1, min(1.0, cfg.scrape_max_age_s))
        gw.registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self.enabled:
            return
        g = GaugeMetricFamily(
            "duetime_gateway_backend_metrics_stale",
            "1 while the backend's own /metrics is not trusted (none, too old, or unreadable)",
            labels=["backend"],
        )
        mono = time.monotonic()
        for b in self.gw.backends:
            g.add_metric([b.url], 0.0 if b.scrape.fresh(mono, self.max_age_s) else 1.0)
        yield g

    @property
    def interval_s(self) -> float:
        return self.gw.config.scrape_interval_s

    async def poll(self, b: Backend) -> None:
        """Read ``b``'s ``/metrics`` once; whatever it answers, the loop goes on."""
        client = self.client
        sent, done = b.sent, b.done  # the counts since this scrape start now
        s = b.scrape
        try:
            r = await client.get(b.url + "/metrics", timeout=self.timeout_s)
            if 400 <= r.status_code < 500:
                raise _refusal(b.url, r.status_code)
            if r.status_code != 200:
                s.error = f"/metrics answered HTTP {r.status_code}"
            else:
                s.record(parse_metrics(r.text, b.url), time.monotonic(), sent, done)
        except MetricsFormatError as e:
            if s.error != str(e):
                log.error("backend %s: %s", b.url, e)
            s.error, s.load = str(e), None  # a format not understood is never trusted
        except Exception as e:  # unreachable: the last good scrape ages out on its own
            s.error = f"/metrics not reachable ({transport_words(e)})"

    def health(self, b: Backend) -> dict[str, Any]:
        """``b``'s entry under ``metrics`` in the gateway's ``/health``."""
        s = b.scrape
        mono = time.monotonic()
        if not self.enabled:
            return {"scraped": False}
        age = s.age_s(mono)
        out: dict[str, Any] = {
            "scraped": True,
            "kind": s.kind,
            "stale": not s.fresh(mono, self.max_age_s),
            "age_ms": None if age is None else round(age * 1000, 1),
            "error": s.error,
        }
        if s.load is not None:
            e = s.estimate(b.sent, b.done, 1)
            out.update(
                running=e.running,
                waiting=e.waiting,
                kv_used=e.kv_used if s.load.kv_capacity else None,
                kv_capacity=s.load.kv_capacity,
                kv_usage=round(s.load.kv_usage, 4),
                prefix_hit_rate=round(e.hit_rate, 4),
            )
        return out
