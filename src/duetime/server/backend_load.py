"""A backend's load between two scrapes: the last scrape plus what the gateway did since.

A scrape is a photograph taken every ``--scrape-interval-ms``; requests keep
arriving in between, and a router that saw only the photograph would send a whole
burst to the backend that looked idle. So the gateway counts each request it sends
to a backend and each one that ends there (:class:`~.gateway_routing.Backend`'s
``sent`` / ``done``, totals that only grow), and a scrape remembers both totals as
they were when it was asked for. The load a router sees is then

    outstanding = scraped running + scraped waiting + (sent since) - (done since)

New requests join the backend's queue when it has one, else its batch; ended ones
leave the batch, and the queue's head takes their places. The KV in use moves by
the same count, each request taken to hold the scraped mean per running request
(or its own prompt when nothing runs). A scrape older than the staleness bound is
not trusted: the router then sees the gateway's own counts, as with no scrape.

Counting from the moment a scrape is *asked for* means a request sent while the
answer travels may be counted twice (in the scrape and since): the error leans
towards a busier backend, and lasts one interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duetime.server.backend_metrics import BackendLoad

__all__ = ["Estimate", "Scraped"]

#: KV tokens a backend is taken to have when it publishes only the fraction in use
#: (least-kv compares fractions, so any fixed size gives the same choices).
NOMINAL_KV_TOKENS = 1_000_000


@dataclass(slots=True, frozen=True)
class Estimate:
    """A backend's load now, as the snapshot carries it."""

    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    hit_rate: float  # share of queried prompt tokens the prefix cache supplied lately


@dataclass(slots=True)
class Scraped:
    """The last good scrape of one backend, and why the latest one failed, if it did."""

    load: BackendLoad | None = None
    at: float = -math.inf  # monotonic time its answer arrived
    base_sent: int = 0  # the backend's ``sent`` total when it was asked for
    base_done: int = 0
    hit_rate: float = 0.0
    error: str | None = None  # the latest attempt's failure; None once one succeeds
    kind: str | None = None  # "duetime" or "vllm", once known

    def record(self, load: BackendLoad, at: float, sent: int, done: int) -> None:
        """Keep a good scrape (asked for when the totals were ``sent`` / ``done``)."""
        prev = self.load
        hits, queries = load.prefix_hits, load.prefix_queries
        if hits is not None and queries is not None:
            if prev is not None and prev.prefix_hits is not None and prev.prefix_queries:
                # the rate since the previous scrape: what the cache holds now, not at start
                dq, dh = queries - prev.prefix_queries, hits - prev.prefix_hits
                if dq > 0 and dh >= 0:
                    self.hit_rate = min(1.0, dh / dq)
            elif queries > 0:
                self.hit_rate = min(1.0, max(0.0, hits / queries))
        self.load, self.at, self.base_sent, self.base_done = load, at, sent, done
        self.kind, self.error = load.kind, None

    def fresh(self, mono: float, max_age_s: float) -> bool:
        """Whether the last good scrape may be trusted at ``mono``: it is at most
        ``max_age_s`` old (one of a format not understood is dropped at once)."""
        return self.load is not None and mono - self.at <= max_age_s

    def age_s(self, mono: float) -> float | None:
        """Seconds since the last good scrape (None: none yet)."""
        return None if self.load is None else mono - self.at

    def estimate(self, sent: int, done: int, request_tokens: int) -> Estimate:
        """The load now, given the backend's ``sent`` / ``done`` totals; a request
        that starts on an idle backend is taken to hold ``request_tokens`` of KV."""
        load = self.load
        assert load is not None, "estimate() needs a scrape"
        run, wait = load.running, load.waiting
        net = (sent - self.base_sent) - (done - self.base_done)
        if net >= 0:
            if wait > 0:
                wait += net
            else:
                run += net
        else:
            total = max(0, run + wait + net)
            wait = max(0, wait + net)
            run = total - wait
        cap = load.kv_capacity or NOMINAL_KV_TOKENS
        used = load.kv_used if load.kv_used is not None else round(load.kv_usage * cap)
        each = used / load.running if load.running else max(1, request_tokens)
        kv = min(cap, max(0, round(used + net * each)))
        return Estimate(run, wait, kv, cap, self.hit_rate)
