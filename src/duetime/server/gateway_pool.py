"""The gateway's shared state: its backends, their health, the wait queue, the metrics.

:class:`Gateway` hands out backend slots (``acquire`` / ``release``), holds
requests that find every backend full in a queue ordered by deadline, then
priority, then arrival, and keeps each backend's up/down and suspect state
from health probes and from what forwarded requests saw.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from duetime.server.errors import ApiError
from duetime.server.gateway_routing import Backend, GatewayConfig, choose_backend, routable

log = logging.getLogger("duetime.gateway")


def model_ids(payload: Any) -> list[dict[str, Any]]:
    """The model entries of a ``/v1/models`` answer; anything malformed counts as none."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [d for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]


@dataclass(order=True, slots=True)
class _Waiter:
    deadline: float
    neg_priority: int
    seq: int
    max_tokens: int = field(compare=False)
    model: str | None = field(compare=False)
    exclude: frozenset[str] = field(compare=False)
    future: asyncio.Future = field(compare=False)


class Gateway:
    """Backends, their health, the wait queue and the metrics."""

    def __init__(
        self,
        urls: list[str],
        config: GatewayConfig | None = None,
        profiles: dict[str, dict[str, float]] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("the gateway needs at least one backend")
        self.config = config or GatewayConfig()
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        for b in self.backends:
            p = (profiles or {}).get(b.url)
            if p:
                b.ttft_s = float(p.get("ttft_s", b.ttft_s))
                b.tpot_s = float(p.get("tpot_s", b.tpot_s))
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self.client: httpx.AsyncClient | None = None
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

    # --- health -------------------------------------------------------------------
    def mark(self, b: Backend, up: bool) -> None:
        if b.up != up:
            log.warning("backend %s is %s", b.url, "up" if up else "down")
        b.up = up
        self.m_up.labels(b.url).set(1 if up else 0)
        if up:
            self._pump()
        else:
            self._fail_stranded()

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
        except Exception as e:  # a probe that raises must not stop probing for good
            log.debug("probe of %s failed: %r", b.url, e)
            ok = False
        self.mark(b, ok)

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(b) for b in self.backends), return_exceptions=True)
            await asyncio.sleep(self.config.health_interval_s)

    # --- slots --------------------------------------------------------------------
    def _take(self, b: Backend) -> Backend:
        b.in_flight += 1
        self.m_inflight.labels(b.url).set(b.in_flight)
        return b

    def release(self, b: Backend) -> None:
        b.in_flight -= 1
        self.m_inflight.labels(b.url).set(b.in_flight)
        self._pump()

    def _pump(self) -> None:
        """Hand free slots to waiters, earliest deadline first.

        A waiter whose backends are all busy does not hold up the ones behind it
        that another (free) backend can serve: requests for different models, or
        retries that exclude a backend, share one queue.
        """
        served: list[_Waiter] = []
        for w in sorted(self._queue):
            if not any(b.up and b.in_flight < self.config.max_inflight for b in self.backends):
                break
            if w.future.done():
                served.append(w)
                continue
            cands = [b for b in self.backends if b.url not in w.exclude]
            b = choose_backend(cands, w.max_tokens, self.config.max_inflight, w.model)
            if b is not None:
                w.future.set_result(self._take(b))
                served.append(w)
        self._drop(served)

    def _drop(self, waiters: list[_Waiter]) -> None:
        if waiters:
            gone = {id(w) for w in waiters}
            self._queue = [w for w in self._queue if id(w) not in gone]
            heapq.heapify(self._queue)
        self.m_queued.set(len(self._queue))

    def _up_for(self, model: str | None, exclude: frozenset[str] = frozenset()) -> list[Backend]:
        return [b for b in self.backends if b.up and b.url not in exclude and b.serves(model)]

    def _fail_stranded(self) -> None:
        """Fail the waiters that no backend still up could serve (their model's went down)."""
        stranded = [w for w in self._queue if not self._up_for(w.model, w.exclude)]
        for w in stranded:
            if not w.future.done():
                w.future.set_exception(_no_backend(w.model))
        self._drop(stranded)

    async def acquire(
        self,
        max_tokens: int,
        deadline_s: float | None,
        priority: int,
        model: str | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Backend:
        """A backend slot: at once if one is free, else after the requests due earlier."""
        if model is not None:
            known = {m for b in self.backends for m in b.models}
            if known and model not in known:
                raise ApiError(
                    404,
                    f"model {model!r} does not exist; the backends serve {sorted(known)}",
                    type="not_found_error",
                    param="model",
                    code="model_not_found",
                )
        up = self._up_for(model, exclude)
        if not up:
            raise _no_backend(model)
        if deadline_s is not None:
            # Predicted finish including the queue ahead, spread over the backends it may use.
            pool = routable(up, time.monotonic())
            share = len(self._queue) / len(pool)
            best = min((share + b.in_flight + 1) * b.request_time(max_tokens) for b in pool)
            if best > deadline_s:
                raise ApiError(
                    429,
                    f"deadline unreachable: the earliest predicted finish is {best * 1000:.0f} ms, "
                    f"the deadline {deadline_s * 1000:.0f} ms",
                    type="rate_limit_error",
                    code="deadline_unreachable",
                    headers={"Retry-After": str(max(1, math.ceil(best - deadline_s)))},
                )
        if len(self._queue) >= self.config.max_queue:
            raise ApiError(
                429,
                "the gateway queue is full",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        now = time.monotonic()
        due = math.inf if deadline_s is None else now + deadline_s
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        w = _Waiter(due, -priority, next(self._seq), max_tokens, model, exclude, fut)
        heapq.heappush(self._queue, w)
        self._pump()
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns a result that arrives
            # together with a cancellation, so a client that left just as a slot was
            # granted took the slot with it, and the backend lost it for good.
            async with asyncio.timeout(self.config.request_timeout_s):
                return await fut
        except BaseException as e:  # the client left, or no slot came in time
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # granted just as the wait ended: give it back
            if isinstance(e, TimeoutError):
                raise ApiError(
                    504, "timed out waiting for a backend", type="server_error"
                ) from None
            raise
        finally:
            if w in self._queue:
                self._drop([w])


def _no_backend(model: str | None) -> ApiError:
    what = "no backend" if model is None else f"no backend serving {model!r}"
    return ApiError(503, f"{what} is up", type="server_error", code="no_backend")
