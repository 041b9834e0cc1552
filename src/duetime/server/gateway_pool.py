"""The gateway's shared state: its backends, their health, the router, the wait queue.

:class:`Gateway` asks its router (:mod:`duetime.routers`) where each request
goes and carries the answer out as the simulated fleet (``sim/fleet.py``) does:

* ``Route(i)``: a slot on backend ``i`` now if it has one, else the request
  waits for one there (ordered by deadline, then priority, then arrival);
* ``Wait(key)``: the fleet queue, smallest key first, offered to the router
  again each time a request ends;
* ``Refuse(reason, retry_after_s)``: 429 with ``Retry-After`` and the reason.

A request waiting for a backend that goes down or turns suspect is offered to
the router again, as the simulated fleet offers a failed replica's requests.
The gateway also keeps each backend's up/down and suspect state from health
probes and from what forwarded requests saw (``admit`` / ``release``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from duetime.core.router import Refuse, Route, Router, Wait, bad_route
from duetime.routers import make_router
from duetime.server.errors import ApiError
from duetime.server.gateway_fleet import Ask, Grant, make_offer, refusal
from duetime.server.gateway_poll import poll_backends
from duetime.server.gateway_profiles import give_profile
from duetime.server.gateway_routing import Backend, GatewayConfig
from duetime.server.gateway_wire import Upstream

log = logging.getLogger("duetime.gateway")


def model_ids(payload: Any) -> list[dict[str, Any]]:
    """The model entries of a ``/v1/models`` answer; anything malformed counts as none."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [d for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]


@dataclass(order=True, slots=True)
class _Waiter:
    """A request waiting: for a slot on ``backend`` (its key: the absolute deadline,
    inf without one), or in the fleet queue (``backend`` None; its key: the router's)."""

    key: float
    neg_priority: int
    seq: int
    ask: Ask = field(compare=False)
    arrival: float = field(compare=False)
    exclude: frozenset[str] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    backend: int | None = field(default=None, compare=False)
    forecast: tuple[float, float] = field(default=(0.0, 0.0), compare=False)


class Gateway:
    """Backends, their health, the wait queue and the metrics."""

    def __init__(
        self,
        urls: list[str],
        config: GatewayConfig | None = None,
        profiles: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("the gateway needs at least one backend")
        self.config = config or GatewayConfig()
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        for b in self.backends:
            p = (profiles or {}).get(b.url)
            if p and "coefficients" in p:
                give_profile(b, p)
            elif p:
                b.ttft_s = float(p.get("ttft_s", b.ttft_s))
                b.tpot_s = float(p.get("tpot_s", b.tpot_s))
                b.seeded = True
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self.router: Router = make_router(self.config.router, seed=self.config.router_seed)
        self.t0 = time.monotonic()  # the routers' clock starts at 0 here
        self.client: httpx.AsyncClient | None = None  # probes, scrapes, /v1/models
        self.upstream: Upstream | None = None  # the forwarded requests
        self.registry = CollectorRegistry()
        self.m_up = Gauge(
            "duetime_gateway_backend_up", "1 if up", ["backend"], registry=self.registry
        )
        self.m_inflight = Gauge(
            "duetime_gateway_backend_in_flight",
            "Requests in flight",
            ["backend"],
            registry=self.registry,
        )
        self.m_requests = Counter(
            "duetime_gateway_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.m_retries = Counter(
            "duetime_gateway_retries", "Requests retried on another backend", registry=self.registry
        )
        self.m_queued = Gauge("duetime_gateway_queued", "Requests waiting", registry=self.registry)
        self.m_suspect = Gauge(
            "duetime_gateway_backend_suspect",
            "1 while suspect: read timeouts in a row, no answer since",
            ["backend"],
            registry=self.registry,
        )
        for b in self.backends:
            self.m_up.labels(b.url).set(0)
            self.m_inflight.labels(b.url).set(0)
            self.m_suspect.labels(b.url).set(0)

    def connect(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        """Reach the backends through ``transport``: forwarded requests straight to it
        (:class:`Upstream`), the probes, scrapes and model lists through an httpx client."""
        self.client = httpx.AsyncClient(trust_env=False, timeout=timeout, transport=transport)
        self.upstream = Upstream(transport, timeout)

    # --- health -------------------------------------------------------------------
    def mark(self, b: Backend, up: bool) -> None:
        if b.up != up:
            log.warning("backend %s is %s", b.url, "up" if up else "down")
        b.up = up
        self.m_up.labels(b.url).set(1 if up else 0)
        if up:
            self._pump()
        else:
            i = self.backends.index(b)
            # What waited for b is routed again; what waits in the fleet queue with no
            # backend left for its model fails now (503) instead of waiting out its timeout.
            self._offer_again(
                lambda w: (
                    w.backend == i
                    or (w.backend is None and not self._up_for(w.ask.model, w.exclude))
                )
            )

    def timed_out(self, b: Backend) -> None:
        """Count a read timeout; ``suspect_after_timeouts`` in a row make ``b`` suspect.

        Each further timeout (one on probation included) starts a new cool-down.
        """
        b.timeouts += 1
        n = self.config.suspect_after_timeouts
        if n and b.timeouts >= n:
            if not b.suspect_until:
                log.warning("backend %s is suspect: %d timeouts in a row", b.url, b.timeouts)
            b.suspect_until = time.monotonic() + self.config.suspect_cooldown_s
            self.m_suspect.labels(b.url).set(1)
            i = self.backends.index(b)
            self._offer_again(lambda w: w.backend == i)  # not left to wait on a hang

    def answered(self, b: Backend) -> None:
        """An answer (of any status) arrived whole: ``b`` does not hang."""
        b.timeouts = 0
        if b.suspect_until:
            log.warning("backend %s answers again: no longer suspect", b.url)
            b.suspect_until = 0.0
            self.m_suspect.labels(b.url).set(0)
            self._pump()  # it may take more than one request again

    async def probe(self, b: Backend) -> None:
        """Health and model list of one backend; whatever it answers, the loop goes on."""
        assert self.client is not None
        try:
            r = await self.client.get(b.url + "/health", timeout=1.0)
            ok = r.status_code == 200
            if ok and not b.models:
                m = await self.client.get(b.url + "/v1/models", timeout=1.0)
                b.models = [d["id"] for d in model_ids(m.json())]
        except httpx.TimeoutException as e:  # busy or dead: down only after a few in a row
            b.probe_timeouts += 1
            log.debug("probe of %s timed out (%d in a row): %r", b.url, b.probe_timeouts, e)
            if b.probe_timeouts < self.config.down_after_probe_timeouts:
                return
            ok = False
        except Exception as e:  # a probe that raises must not stop probing for good
            log.debug("probe of %s failed: %r", b.url, e)
            ok = False
        else:
            b.probe_timeouts = 0
        self.mark(b, ok)

    async def health_loop(self) -> None:
        while True:
            await poll_backends(self.backends, self.probe)
            await asyncio.sleep(self.config.health_interval_s)

    # --- routing ------------------------------------------------------------------
    def clock(self) -> float:
        """The routers' clock: seconds since the gateway started (a snapshot's ``now``)."""
        return time.monotonic() - self.t0

    def _queued(self) -> list[int]:
        """Requests waiting for a slot on each backend (the snapshot's ``waiting``)."""
        n = [0] * len(self.backends)
        for w in self._queue:
            if w.backend is not None and not w.future.done():
                n[w.backend] += 1
        return n

    def _decide(self, w: _Waiter) -> bool:
        """Ask the router about ``w`` now and carry the answer out: True when it was
        granted a slot, False when it is to wait (bound to a backend, or in the fleet
        queue). Raises the refusals (429, 503) and a router's mistake (500)."""
        mono = time.monotonic()
        now = mono - self.t0
        offer = make_offer(
            self.backends,
            self._queued(),
            w.ask,
            rid=w.seq,
            arrival=w.arrival,
            now=now,
            mono=mono,
            max_inflight=self.config.max_inflight,
            exclude=w.exclude,
            max_age_s=self.config.scrape_max_age_s if self.config.scrape_interval_s > 0 else None,
        )
        dec = self.router.route(offer.snap)
        if isinstance(dec, Route):
            i = dec.replica
            why = bad_route(i, len(self.backends))
            if why is None and not offer.snap.up[i]:
                why = f"backend {i}, which was not offered"
            if why is not None:
                raise ApiError(
                    500,
                    f"router {self.router.name!r} chose {why}",
                    type="server_error",
                    code="router_error",
                )
            i = int(i)
            w.backend = i
            w.key = math.inf if w.ask.deadline_s is None else w.arrival + w.ask.deadline_s
            w.forecast = (
                float(offer.finish[i]) - w.arrival,
                float(offer.first[i]) - w.arrival,
            )
            return self._try_grant(w, mono)
        if isinstance(dec, Wait):
            w.backend = None
            w.key = dec.key
            return False
        if isinstance(dec, Refuse):
            code = "refused" if w.ask.deadline_s is None else "deadline_unreachable"
            raise refusal(dec.reason, dec.retry_after_s, code)
        raise ApiError(500, f"router {self.router.name!r} answered {dec!r}", type="server_error")

    def _try_grant(self, w: _Waiter, mono: float) -> bool:
        """Give ``w`` a slot on its backend if that one is up and has room."""
        assert w.backend is not None
        b = self.backends[w.backend]
        if not (b.up and b.in_flight < b.limit(mono, self.config.max_inflight)):
            return False
        if not w.future.done():
            w.future.set_result(Grant(self._take(b), *w.forecast, context=w.ask.context))
        return True

    def _offer_again(self, which: Callable[[_Waiter], bool]) -> None:
        """Offer the waiters ``which`` selects to the router again (their backend went
        down or turned suspect), as the simulated fleet offers a failed replica's."""
        gone: list[_Waiter] = []
        for w in sorted(self._queue):
            if w.future.done():
                gone.append(w)
            elif which(w):
                w.backend = None
                if self._decide_queued(w):
                    gone.append(w)
        self._drop(gone)

    def _decide_queued(self, w: _Waiter) -> bool:
        """``_decide`` for a waiter already queued: True when it leaves the queue
        (granted, or failed with the refusal its client then gets)."""
        try:
            return self._decide(w)
        except ApiError as e:
            w.future.set_exception(e)
            return True

    # --- slots --------------------------------------------------------------------
    def _take(self, b: Backend) -> Backend:
        b.in_flight += 1
        b.sent += 1
        self.m_inflight.labels(b.url).set(b.in_flight)
        return b

    def release(self, b: Backend) -> None:
        b.in_flight -= 1
        b.done += 1
        self.m_inflight.labels(b.url).set(b.in_flight)
        self._pump()

    def _pump(self) -> None:
        """Hand free slots to the waiters bound to each backend, earliest deadline first,
        and offer the fleet queue to the router again, smallest key first, until one
        is told to wait again (as the simulated fleet does when a request ends)."""
        if not self._queue:
            return
        mono = time.monotonic()
        served: list[_Waiter] = []
        fleet_open = True
        for w in sorted(self._queue):
            if w.future.done():
                served.append(w)
            elif w.backend is not None:
                if self._try_grant(w, mono):
                    served.append(w)
            elif fleet_open:
                if self._decide_queued(w):
                    served.append(w)
                elif w.backend is None:
                    fleet_open = False
        self._drop(served)

    def _drop(self, waiters: list[_Waiter]) -> None:
        if waiters:
            gone = {id(w) for w in waiters}
            self._queue = [w for w in self._queue if id(w) not in gone]
        heapq.heapify(self._queue)  # keys change when a waiter is routed again
        self.m_queued.set(len(self._queue))

    def _up_for(self, model: str | None, exclude: frozenset[str] = frozenset()) -> list[Backend]:
        return [b for b in self.backends if b.up and b.url not in exclude and b.serves(model)]

    async def acquire(
        self,
        max_tokens: int,
        deadline_s: float | None,
        priority: int,
        model: str | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Backend:
        """A backend slot for a request known by its body fields alone (see :meth:`admit`)."""
        ask = Ask(max_tokens, deadline_s, None, priority, model)
        return (await self.admit(ask, exclude)).backend

    async def admit(self, ask: Ask, exclude: frozenset[str] = frozenset()) -> Grant:
        """A backend slot for ``ask``, where the router sends it: at once if that backend
        has room, else when a slot frees there for it. Raises the refusals."""
        if ask.model is not None:
            known = {m for b in self.backends for m in b.models}
            if known and ask.model not in known:
                raise ApiError(
                    404,
                    f"model {ask.model!r} does not exist; the backends serve {sorted(known)}",
                    type="not_found_error",
                    param="model",
                    code="model_not_found",
                )
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        w = _Waiter(math.inf, -ask.priority, next(self._seq), ask, self.clock(), exclude, fut)
        if self._decide(w):
            return fut.result()
        if len(self._queue) >= self.config.max_queue:
            raise ApiError(
                429,
                "the gateway queue is full",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        heapq.heappush(self._queue, w)
        self.m_queued.set(len(self._queue))
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns a result that arrives
            # together with a cancellation, so a client that left just as a slot was
            # granted took the slot with it, and the backend lost it for good.
            async with asyncio.timeout(self.config.request_timeout_s):
                return await fut
        except BaseException as e:  # the client left, or no slot came in time
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result().backend)  # granted just as the wait ended
            if isinstance(e, TimeoutError):
                raise ApiError(
                    504, "timed out waiting for a backend", type="server_error"
                ) from None
            raise
        finally:
            if w in self._queue:
                self._drop([w])
