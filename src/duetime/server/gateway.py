"""`duetime gateway`: duetime's policies in front of several OpenAI-compatible backends.

The gateway does not generate. It admits, orders and routes requests to
backends (``duetime serve`` processes, or a vLLM/SGLang fleet) and passes their
answers, streamed or whole, through byte for byte.

This module is the HTTP side: the app, its routes, and a request forwarded with its
one retry. What it reads of a body and how it watches the client are in
:mod:`.gateway_request`, a whole answer and a backend's failures in
:mod:`.gateway_upstream`, a streamed answer's relay in :mod:`.gateway_stream`; the
per-backend estimates are in :mod:`.gateway_routing`, the fleet snapshot the
router sees in :mod:`.gateway_fleet`, the router's answers carried out, the slots,
wait queue, health and metrics in :mod:`.gateway_pool`, the scrapes of each
backend's own ``/metrics`` in :mod:`.gateway_scrape`, the reads of each backend's
published step-cost model in :mod:`.gateway_profiles`, the HTTP/1.1 connections to the
backends in :mod:`.gateway_wire`.

* **Routing**: a router of :mod:`duetime.routers` (``GatewayConfig.router``, the
  routers ``duetime sim --router`` runs) chooses each request's backend from a
  :class:`~duetime.core.router.FleetSnapshot` of the backends: running, waiting,
  KV use and prefix-cache hit rate as each backend's own ``/metrics`` last said
  (``scrape_interval_s``), moved by what the gateway sent and saw end since (its
  own counts alone once a scrape is older than ``scrape_max_age_s``), and a
  forecast finish from each backend's moving averages of the time
  to first token and the seconds per output token, the backend taken as a batch of
  ``max_inflight`` slots (:mod:`.gateway_fleet`). The default, ``forecast``, takes
  the earliest one.
* **Admission**: deadlines come from the body (``deadline_ms``) or headers
  (``x-deadline-ms``; llm-d's ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``); a router's
  refusal, and a TTFT bound no backend's forecast meets, are 429 with
  ``Retry-After`` at once. The answer names its backend and forecast in headers.
* **Ordering**: a request routed to a backend at ``max_inflight`` waits for a
  slot there, ordered by absolute deadline (then priority, then arrival).
* **Failures**: a connection error (refused, reset, connect timeout) marks the
  backend down at once (the health probe brings it back). A request that
  failed before any byte reached its client is retried once on another
  backend; a stream that breaks midway ends with an SSE ``error`` event naming
  the backend, then ``data: [DONE]``. A read timeout once the request reached
  the backend answers 504 and is neither retried nor marked down (its
  slowness is fed to its estimate instead).
* **Hanging backends**: ``suspect_after_timeouts`` read timeouts in a row make a
  backend suspect (it may answer ``/health`` and hang on completions): for
  ``suspect_cooldown_s`` it gets no request another backend could take, then
  one at a time until an answer arrives whole, which clears it. When every
  backend for a model is suspect they are used anyway.
* **Clients that leave**: queued, waiting for a whole answer or a stream's first
  byte, or streaming, the upstream request is closed (so the backend frees its
  sequence) and the slot or queue place is given back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from duetime.server.errors import ApiError, BodyLimit, install_error_handlers
from duetime.server.gateway_fleet import Ask, Grant, make_offer
from duetime.server.gateway_poll import poll_backends
from duetime.server.gateway_pool import Gateway, model_ids
from duetime.server.gateway_profiles import ProfileReader
from duetime.server.gateway_request import (
    _ClientGoneError,
    _request_fields,
    _unless_client_leaves,
    earliest,
    header_deadlines,
    parse_body,
)
from duetime.server.gateway_routing import Backend, GatewayConfig, routable
from duetime.server.gateway_scrape import Scraper
from duetime.server.gateway_stream import _open_stream, stream_tokens
from duetime.server.gateway_upstream import _BackendFailedError, _whole
from duetime.server.gateway_wire import KeepAliveTransport
from duetime.server.paths import StripTrailingSlash

__all__ = [
    "Ask",
    "Backend",
    "Gateway",
    "GatewayConfig",
    "Grant",
    "create_gateway_app",
    "make_offer",
    "model_ids",
    "routable",
    "stream_tokens",
]

log = logging.getLogger("duetime.gateway")


def create_gateway_app(
    backends: list[str],
    config: GatewayConfig | None = None,
    profiles: dict[str, dict[str, Any]] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The gateway's ASGI app in front of ``backends`` (base URLs, without ``/v1``).

    ``transport`` replaces the network (tests put fake backends behind it); its
    requests still carry the configured timeouts in ``request.extensions``.
    """
    gw = Gateway(backends, config, profiles)
    cfg = gw.config
    scraper = Scraper(gw)
    profiles_reader = ProfileReader(gw)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        wire = transport or KeepAliveTransport(max_idle_per_backend=max(16, cfg.max_inflight * 2))
        gw.connect(wire, httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s))
        await poll_backends(gw.backends, gw.probe)
        tasks = [asyncio.create_task(gw.health_loop())]
        for poller in (scraper, profiles_reader):
            if poller.enabled:  # the first requests are routed on what it read too
                await poller.poll_all()
                tasks.append(asyncio.create_task(poller.loop()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            assert gw.client is not None
            await gw.client.aclose()  # closes the transport, and with it the kept connections

    app = FastAPI(title="duetime gateway", version="0.1", lifespan=lifespan)
    install_error_handlers(app)
    # A body refused before any route runs is an outcome too: /metrics counts every request.
    app.add_middleware(
        BodyLimit,
        max_bytes=cfg.max_body_bytes,
        on_refuse=lambda status: gw.m_requests.labels(f"http_{status}").inc(),
        timeout_s=cfg.body_timeout_s,
    )
    app.add_middleware(StripTrailingSlash)
    app.state.gateway = gw
    # a connection closed for late headers (header_timeout) never reached a route
    app.state.on_header_timeout = lambda: gw.m_requests.labels("http_408").inc()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> JSONResponse:
        ok = any(b.up for b in gw.backends)
        return JSONResponse(
            {
                "status": "ok" if ok else "no backend up",
                "backends": [
                    {
                        "url": b.url,
                        "up": b.up,
                        "in_flight": b.in_flight,
                        "prefilling": b.prefilling,
                        "ttft_ms": round(b.ttft_s * 1000, 3),
                        "tpot_ms": round(b.tpot_s * 1000, 3),
                        "suspect": b.suspect_until > 0,
                        "timeouts": b.timeouts,
                        "metrics": scraper.health(b),
                        "profile": profiles_reader.health(b),
                    }
                    for b in gw.backends
                ],
                "queued": len(gw._queue),
                "router": gw.router.name,
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type="text/plain; version=0.0.4")

    async def served_models() -> dict[str, dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        assert gw.client is not None
        for b in gw.backends:
            if not b.up:
                continue
            try:
                r = await gw.client.get(b.url + "/v1/models", timeout=2.0)
                for d in model_ids(r.json()):
                    seen.setdefault(d["id"], d)
            except (httpx.HTTPError, ValueError):
                continue
        return seen

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list((await served_models()).values())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """One model, as OpenAI's ``models.retrieve`` asks for it: a backend up serves it."""
        seen = await served_models()
        if model not in seen:
            raise ApiError(
                404,
                f"model {model!r} is served by no backend that is up; they serve "
                f"{', '.join(map(repr, seen)) or 'nothing now'}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return seen[model]

    # Plain Starlette routes: the request is relayed as bytes, so FastAPI's dependency
    # solving and exit stack per request (~10 % of the gateway thread) buy nothing here.
    async def completions(request: Request) -> Response:
        return await _forward(gw, request, "/v1/completions", chat=False)

    async def chat(request: Request) -> Response:
        return await _forward(gw, request, "/v1/chat/completions", chat=True)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])

    return app


async def _forward(gw: Gateway, request: Request, path: str, *, chat: bool) -> Response:
    raw = await request.body()
    try:
        body = parse_body(raw, request.headers.get("content-type", ""))
        max_tokens, deadline, prio, model, stream = _request_fields(body, chat)
        by_header, ttft = header_deadlines(request.headers, max_tokens)
    except ApiError as e:  # a refused body is an outcome too: /metrics counts every request
        gw.m_requests.labels(f"http_{e.status}").inc()
        raise
    # bytes / 4: a rough token count for the snapshot; the gateway does not tokenize
    ask = Ask(max_tokens, earliest(deadline, by_header), ttft, prio, model, len(raw) // 4)
    t0 = time.monotonic()
    tried: set[str] = set()
    last: _BackendFailedError | None = None
    for _attempt in range(2):  # one retry on another backend, only while nothing was sent
        now_ask = ask.later(time.monotonic() - t0)
        if now_ask.deadline_s is not None and now_ask.deadline_s <= 0:
            break
        try:
            grant = await _unless_client_leaves(request, gw.admit(now_ask, frozenset(tried)))
        except _ClientGoneError:
            gw.m_requests.labels("client_gone").inc()
            return Response(status_code=499)
        except ApiError as e:
            if last is not None:
                break
            gw.m_requests.labels(f"http_{e.status}").inc()
            raise
        tried.add(grant.backend.url)
        if last is not None:
            gw.m_retries.inc()
        try:
            send = _open_stream if stream else _whole
            return await _unless_client_leaves(request, send(gw, grant, path, raw, max_tokens))
        except _ClientGoneError:  # the cancellation closed the upstream request
            gw.m_requests.labels("client_gone").inc()
            return Response(status_code=499)
        except _BackendFailedError as e:
            last = e
            continue
    gw.m_requests.labels("failed").inc()
    msg = str(last) if last is not None else "the deadline passed before a retry"
    raise ApiError(502, msg, type="server_error", code="backend_failed")
