"""What the gateway knows of each backend: its configuration, health and estimates.

Pure bookkeeping, no I/O, so it is testable with an explicit clock. Each
backend keeps its in-flight count and moving averages of the time to first
token and the seconds per output token seen on completed answers; from these
the gateway forecasts, for the routers of :mod:`duetime.core.router`, when a
request would end there (:mod:`.gateway_fleet`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.server.backend_load import Scraped

log = logging.getLogger("duetime.gateway")

_DEFAULT_TTFT_S = 0.05
_DEFAULT_TPOT_S = 0.02


@dataclass(slots=True)
class GatewayConfig:
    """How the gateway routes, probes and times out; `duetime gateway`'s options set it."""

    #: The :mod:`duetime.routers` router that chooses each request's backend
    #: (``duetime routers`` lists them); ``forecast`` goes to the earliest forecast
    #: finish and refuses a deadline no backend's forecast meets.
    router: str = "forecast"
    #: Seed of the router (the random ones draw from it).
    router_seed: int = 0
    max_inflight: int = 8  # per backend
    health_interval_s: float = 0.5
    #: Health probes in a row that time out (1 s each) before a backend is marked down.
    #: A refused connection or an error status marks it down at once; a probe that times
    #: out may be a backend too busy to answer in time, not a dead one: with two engines
    #: and the tests on two cores, one late probe took the only survivor of a killed
    #: backend out of rotation and the gateway answered 503 with nothing down.
    down_after_probe_timeouts: int = 3
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    max_queue: int = 1024
    ewma_alpha: float = 0.2
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body not complete by then: 408
    #: Read timeouts in a row after which a backend is suspect (0: never). A backend
    #: that answers /health but hangs on completions is up for the probe; without
    #: this it kept taking every request the others had no room for.
    suspect_after_timeouts: int = 3
    #: Seconds a suspect backend gets no request that another backend could take;
    #: after that it is on probation (one request at a time) until one is answered.
    suspect_cooldown_s: float = 30.0
    #: Seconds between scrapes of each backend's Prometheus /metrics (its own running,
    #: waiting, KV and prefix-cache figures: :mod:`.backend_metrics`); 0 turns it off.
    scrape_interval_s: float = 0.25
    #: A scrape older than this is not trusted: the router sees the gateway's own
    #: counts for that backend, and /health reports its metrics stale.
    scrape_max_age_s: float = 1.0
    #: Seconds between reads of each backend's published step-cost model
    #: (``GET /v1/profile`` of `duetime serve`: :mod:`.gateway_profiles`); 0 turns it off.
    #: The model moves slowly (an online fit over the last 256 steps), so seldom is enough.
    profile_interval_s: float = 10.0


@dataclass(slots=True)
class PublishedCost:
    """A backend's own step-cost model as it last published it (``GET /v1/profile``)."""

    cost: LinearStepCost | None = None
    body: dict[str, Any] | None = None  # the profile JSON, as read
    at: float | None = None  # monotonic time of the last good read
    #: "ok", "no model yet" (503), "not published" (404: not `duetime serve`), "given"
    #: (``--profile URL=path``: the backend's own is not read), or the error.
    status: str = "not read"


@dataclass(slots=True)
class Backend:
    """One upstream server, as the router sees it."""

    url: str
    up: bool = False
    in_flight: int = 0
    ttft_s: float = _DEFAULT_TTFT_S  # EWMA (or the profile's value until observed)
    #: EWMA of seconds per output token of one sequence alone: with a published cost
    #: model, each answer's pace over the model's slowdown at the batch it ended in
    tpot_s: float = _DEFAULT_TPOT_S
    observed: int = 0
    seeded: bool = False  # ttft_s / tpot_s given by hand (--profile URL=path): they lead
    models: list[str] = field(default_factory=list)
    timeouts: int = 0  # read timeouts in a row; any answer that arrives whole resets it
    probe_timeouts: int = 0  # health probes in a row that timed out; an answer resets it
    suspect_until: float = 0.0  # monotonic end of the cool-down; 0: not suspect
    #: Streams sent here whose first byte has not come back: the prompts ahead of a new
    #: one in this backend's prefill queue (a whole answer's first token is not seen).
    prefilling: int = 0
    sent: int = 0  # requests the gateway has sent here (only grows: scrapes count from it)
    done: int = 0  # of those, the ones that ended
    scrape: Scraped = field(default_factory=Scraped)  # its own /metrics, last read
    published: PublishedCost = field(default_factory=PublishedCost)  # its own cost model

    def ejected(self, now: float) -> bool:
        """Suspect and within its cool-down: no traffic while another backend can take it."""
        return now < self.suspect_until

    def on_probation(self, now: float) -> bool:
        """Suspect, cool-down over, nothing answered since: one request at a time."""
        return 0.0 < self.suspect_until <= now

    def serves(self, model: str | None) -> bool:
        """Whether a request for ``model`` may go here (a backend not yet listed takes any)."""
        return model is None or not self.models or model in self.models

    def limit(self, now: float, max_inflight: int) -> int:
        """Requests this backend may hold at once: one while on probation."""
        return 1 if self.on_probation(now) else max_inflight

    def batch_slots(self, limit: int) -> int:
        """Sequences this backend runs in one batch, for the forecast: the gateway's
        ``limit`` for it, or the ``max_num_seqs`` of its cost model where fewer (requests
        past that wait in the backend's own queue, not beside the others)."""
        body = self.published.body
        seqs = body.get("max_num_seqs") if body is not None else None
        if isinstance(seqs, int) and not isinstance(seqs, bool) and seqs >= 1:
            return min(limit, seqs)
        return limit

    def request_time(self, max_tokens: int) -> float:
        """Seconds one request of ``max_tokens`` takes here alone, by the estimates."""
        return self.ttft_s + self.tpot_s * max(1, max_tokens)

    def slowdown(self, joins: int, context: int = 1) -> float:
        """How much longer a request takes in a batch of ``joins`` sequences than alone:
        the published cost model's decode step at ``joins`` over its step at one (1
        without a model). ``context``: tokens a sequence attends."""
        cost = self.published.cost
        if cost is None or joins <= 1:
            return 1.0
        return cost.decode_step(joins, joins * context) / cost.decode_step(1, context)

    def estimates(self, prompt_len: int, max_tokens: int) -> tuple[float, float]:
        """``(ttft, alone)``: seconds to the first token and for the whole request alone.

        Before any answer is observed here, a published cost model prices this request's
        own prompt and length (a prefill of ``prompt_len``, then ``max_tokens - 1`` steps of
        one sequence) instead of the blind 50 ms + 20 ms a token; once answers arrive, the
        moving averages, which see the backend's real load, take over.
        """
        cost = self.published.cost
        if self.observed or self.seeded or cost is None:
            return self.ttft_s, self.request_time(max_tokens)
        n = max(1, prompt_len)
        return cost.prefill_time(n), cost.alone_time(n, max_tokens)

    def first_token_time(self, prompt_len: int, ttft: float, running: int, context: int) -> float:
        """Seconds until a request sent here now gets its first token: the prompts ahead
        of it in the prefill queue (:attr:`prefilling`), then its own, each a step beside
        the sequences decoding, after the rest of the step in progress (half a step).

        With a published cost model each of those steps is priced on it, at the batch
        decoding now; without one each prompt ahead takes ``ttft``, the moving average.
        Why not ``ttft`` alone: an average first-token time kept only 81 % of the
        accepted requests within a 500 ms x-slo-ttft-ms bound on a loaded two-backend
        Gemma fleet (docs/gateway.md), since each prompt waits for those ahead of it.
        """
        cost = self.published.cost
        if cost is None:
            return ttft * (1 + self.prefilling)
        n = max(1, prompt_len)
        decoding = max(0, running - self.prefilling)
        kv = decoding * context
        prompt = cost.prompt_step(n, decoding, kv)
        residual = 0.5 * cost.decode_step(decoding, kv) if decoding else 0.0
        return residual + (1 + self.prefilling) * prompt

    def observe(
        self, ttft_s: float | None, e2e_s: float, tokens: int, alpha: float, context: int = 1
    ) -> None:
        """Learn from one answer. ``context``: the tokens its sequence attended on average,
        the context the forecast scales the pace back up at (:attr:`.Ask.context`)."""
        ttft = e2e_s if ttft_s is None else min(ttft_s, e2e_s)
        if tokens > 1:
            # the pace of one sequence alone: the answer ran beside the others in flight
            # as it ended (it still counts itself), slower by the model's step there
            joins = self.batch_slots(max(1, self.in_flight))
            tpot = (e2e_s - ttft) / (tokens - 1) / self.slowdown(joins, context)
        else:
            tpot = self.tpot_s
        if self.observed == 0:
            self.ttft_s, self.tpot_s = ttft, tpot
        else:
            self.ttft_s += alpha * (ttft - self.ttft_s)
            self.tpot_s += alpha * (tpot - self.tpot_s)
        self.observed += 1


def routable(backends: list[Backend], now: float) -> list[Backend]:
    """The backends a request may go to: those not ejected, else all (better a
    suspect backend than none, as Envoy's panic mode and SGLang's router do)."""
    return [b for b in backends if not b.ejected(now)] or backends
