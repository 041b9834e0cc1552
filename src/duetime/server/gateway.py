"""`duetime gateway`: duetime's policies in front of several OpenAI-compatible backends.

The gateway does not generate. It admits, orders and routes requests to
backends (``duetime serve`` processes, or a vLLM/SGLang fleet) and passes their
answers, streamed or whole, through byte for byte.

* **Routing**: each backend keeps its in-flight count and EWMAs of the time to
  first token and the seconds per output token seen on completed answers; the
  predicted finish of a new request there is ``(in_flight + 1) * (ttft +
  tpot * max_tokens)``. The request goes to the backend with the earliest one.
* **Admission**: a request whose ``deadline_ms`` no backend is predicted to meet
  is refused at once with 429 and ``Retry-After``.
* **Ordering**: when every backend is at ``max_inflight``, requests wait in a
  queue ordered by absolute deadline (then priority, then arrival).
* **Failures**: a connection error marks the backend down at once (the health
  probe brings it back). A request that failed before any byte reached its
  client is retried once on another backend; a stream that breaks midway ends
  with an SSE ``error`` event naming the backend, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from duetime.server.errors import ApiError, BodyLimit, install_error_handlers

__all__ = ["Backend", "Gateway", "GatewayConfig", "choose_backend", "create_gateway_app"]

log = logging.getLogger("duetime.gateway")

_DEFAULT_TTFT_S = 0.05
_DEFAULT_TPOT_S = 0.02
_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(slots=True)
class GatewayConfig:
    max_inflight: int = 8  # per backend
    health_interval_s: float = 0.5
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    max_queue: int = 1024
    ewma_alpha: float = 0.2
    max_body_bytes: int = 1 << 20


@dataclass(slots=True)
class Backend:
    """One upstream server, as the router sees it."""

    url: str
    up: bool = False
    in_flight: int = 0
    ttft_s: float = _DEFAULT_TTFT_S  # EWMA (or the profile's value until observed)
    tpot_s: float = _DEFAULT_TPOT_S  # EWMA of seconds per output token
    observed: int = 0
    models: list[str] = field(default_factory=list)

    def request_time(self, max_tokens: int) -> float:
        return self.ttft_s + self.tpot_s * max(1, max_tokens)

    def predicted_finish(self, max_tokens: int) -> float:
        """Seconds from now until a new request of ``max_tokens`` would end here."""
        return (self.in_flight + 1) * self.request_time(max_tokens)

    def observe(self, ttft_s: float | None, e2e_s: float, tokens: int, alpha: float) -> None:
        ttft = e2e_s if ttft_s is None else min(ttft_s, e2e_s)
        tpot = (e2e_s - ttft) / max(1, tokens - 1) if tokens > 1 else self.tpot_s
        if self.observed == 0:
            self.ttft_s, self.tpot_s = ttft, tpot
        else:
            self.ttft_s += alpha * (ttft - self.ttft_s)
            self.tpot_s += alpha * (tpot - self.tpot_s)
        self.observed += 1


def choose_backend(
    backends: list[Backend], max_tokens: int, max_inflight: int, model: str | None = None
) -> Backend | None:
    """The up backend with room and the earliest predicted finish (None: none has room)."""
    best: Backend | None = None
    best_t = math.inf
    for b in backends:
        if not b.up or b.in_flight >= max_inflight:
            continue
        if model is not None and b.models and model not in b.models:
            continue
        t = b.predicted_finish(max_tokens)
        if t < best_t:
            best, best_t = b, t
    return best


class _BackendFailedError(Exception):
    def __init__(self, backend: Backend, cause: BaseException) -> None:
        super().__init__(f"backend {backend.url} failed: {type(cause).__name__}: {cause}")
        self.backend = backend


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
        for b in self.backends:
            self.m_up.labels(b.url).set(0)
            self.m_inflight.labels(b.url).set(0)

    # --- health -------------------------------------------------------------------
    def mark(self, b: Backend, up: bool) -> None:
        if b.up != up:
            log.warning("backend %s is %s", b.url, "up" if up else "down")
        b.up = up
        self.m_up.labels(b.url).set(1 if up else 0)
        if up:
            self._pump()
        elif not any(x.up for x in self.backends):
            self._fail_waiters(ApiError(503, "no backend is up", type="server_error"))

    async def probe(self, b: Backend) -> None:
        assert self.client is not None
        try:
            r = await self.client.get(b.url + "/health", timeout=1.0)
            ok = r.status_code == 200
            if ok and not b.models:
                m = await self.client.get(b.url + "/v1/models", timeout=1.0)
                b.models = [d["id"] for d in m.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError):
            ok = False
        self.mark(b, ok)

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(b) for b in self.backends))
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
        """Hand free slots to waiters, earliest deadline first."""
        while self._queue:
            w = self._queue[0]
            if w.future.done():
                heapq.heappop(self._queue)
                continue
            cands = [b for b in self.backends if b.url not in w.exclude]
            b = choose_backend(cands, w.max_tokens, self.config.max_inflight, w.model)
            if b is None:
                break
            heapq.heappop(self._queue)
            w.future.set_result(self._take(b))
        self.m_queued.set(len(self._queue))

    def _fail_waiters(self, exc: ApiError) -> None:
        while self._queue:
            w = heapq.heappop(self._queue)
            if not w.future.done():
                w.future.set_exception(exc)
        self.m_queued.set(0)

    async def acquire(
        self,
        max_tokens: int,
        deadline_s: float | None,
        priority: int,
        model: str | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Backend:
        """A backend slot: at once if one is free, else after the requests due earlier."""
        cands = [b for b in self.backends if b.url not in exclude]
        up = [b for b in cands if b.up]
        if not up:
            raise ApiError(503, "no backend is up", type="server_error", code="no_backend")
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
        if deadline_s is not None:
            # Predicted finish including the queue ahead, spread over the backends that are up.
            share = len(self._queue) / len(up)
            best = min((share + b.in_flight + 1) * b.request_time(max_tokens) for b in up)
            if best > deadline_s:
                raise ApiError(
                    429,
                    f"deadline unreachable: the earliest predicted finish is {best * 1000:.0f} ms, "
                    f"the deadline {deadline_s * 1000:.0f} ms",
                    type="rate_limit_error",
                    code="deadline_unreachable",
                    headers={"Retry-After": str(max(1, math.ceil(best - deadline_s)))},
                )
        if not self._queue:
            b = choose_backend(cands, max_tokens, self.config.max_inflight, model)
            if b is not None:
                return self._take(b)
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
            return await asyncio.wait_for(fut, self.config.request_timeout_s)
        except TimeoutError:
            raise ApiError(504, "timed out waiting for a backend", type="server_error") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # granted just as the client left
            raise


# --- the app ----------------------------------------------------------------------------
def _request_fields(body: Any, chat: bool) -> tuple[int, float | None, int, str | None, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        mt = 256 if chat else _DEFAULT_MAX_TOKENS
    ms = body.get("deadline_ms", body.get("time_budget_ms"))
    deadline = float(ms) / 1000.0 if isinstance(ms, int | float) and ms > 0 else None
    prio = body.get("priority", 0)
    prio = prio if isinstance(prio, int) and not isinstance(prio, bool) else 0
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return mt, deadline, prio, model, bool(body.get("stream", False))


def _sse_error(message: str, backend: str) -> bytes:
    err = {"message": message, "type": "server_error", "param": None, "code": "backend_failed"}
    err["backend"] = backend
    return b"data: " + json.dumps({"error": err}).encode() + b"\n\n"


def create_gateway_app(
    backends: list[str],
    config: GatewayConfig | None = None,
    profiles: dict[str, dict[str, float]] | None = None,
) -> FastAPI:
    """The gateway's ASGI app in front of ``backends`` (base URLs, without ``/v1``)."""
    gw = Gateway(backends, config, profiles)
    cfg = gw.config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        n = max(16, cfg.max_inflight * len(gw.backends) * 2)
        gw.client = httpx.AsyncClient(
            trust_env=False,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        )
        await asyncio.gather(*(gw.probe(b) for b in gw.backends))
        task = asyncio.create_task(gw.health_loop())
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await gw.client.aclose()

    app = FastAPI(title="duetime gateway", version="0.1", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.state.gateway = gw

    @app.get("/health")
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
                        "ttft_ms": round(b.ttft_s * 1000, 3),
                        "tpot_ms": round(b.tpot_s * 1000, 3),
                    }
                    for b in gw.backends
                ],
                "queued": len(gw._queue),
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        seen: dict[str, dict[str, Any]] = {}
        assert gw.client is not None
        for b in gw.backends:
            if not b.up:
                continue
            try:
                r = await gw.client.get(b.url + "/v1/models", timeout=2.0)
                for d in r.json().get("data", []):
                    seen.setdefault(d["id"], d)
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return {"object": "list", "data": list(seen.values())}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(gw, request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(gw, request, "/v1/chat/completions", chat=True)

    return app


async def _forward(gw: Gateway, request: Request, path: str, *, chat: bool) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    max_tokens, deadline, prio, model, stream = _request_fields(body, chat)
    t0 = time.monotonic()
    tried: set[str] = set()
    last: _BackendFailedError | None = None
    for _attempt in range(2):  # one retry on another backend, only while nothing was sent
        left = None if deadline is None else deadline - (time.monotonic() - t0)
        if left is not None and left <= 0:
            break
        try:
            b = await gw.acquire(max_tokens, left, prio, model, frozenset(tried))
        except ApiError as e:
            if last is not None:
                break
            gw.m_requests.labels(f"http_{e.status}").inc()
            raise
        tried.add(b.url)
        if last is not None:
            gw.m_retries.inc()
        try:
            if stream:
                return await _open_stream(gw, b, path, raw, max_tokens)
            return await _whole(gw, b, path, raw, max_tokens)
        except _BackendFailedError as e:
            last = e
            continue
    gw.m_requests.labels("failed").inc()
    msg = str(last) if last is not None else "the deadline passed before a retry"
    raise ApiError(502, msg, type="server_error", code="backend_failed")


def _headers(b: Backend, upstream: httpx.Response) -> dict[str, str]:
    h = {"X-Duetime-Backend": b.url}
    if "retry-after" in upstream.headers:
        h["Retry-After"] = upstream.headers["retry-after"]
    return h


async def _whole(gw: Gateway, b: Backend, path: str, raw: bytes, max_tokens: int) -> Response:
    assert gw.client is not None
    t0 = time.monotonic()
    try:
        r = await gw.client.post(
            b.url + path, content=raw, headers={"content-type": "application/json"}
        )
    except httpx.TimeoutException as e:
        gw.m_requests.labels("http_504").inc()
        raise ApiError(504, f"backend {b.url} timed out", type="server_error") from e
    except httpx.TransportError as e:
        gw.mark(b, False)
        raise _BackendFailedError(b, e) from e
    finally:
        gw.release(b)
    e2e = time.monotonic() - t0
    if r.status_code == 200:
        with suppress(ValueError, KeyError, TypeError, AttributeError):
            data = r.json()
            tokens = int(data["usage"]["completion_tokens"])
            ttft_ms = (data.get("duetime") or {}).get("ttft_ms")
            b.observe(
                None if ttft_ms is None else ttft_ms / 1000.0, e2e, tokens, gw.config.ewma_alpha
            )
        gw.m_requests.labels("ok").inc()
    else:
        gw.m_requests.labels(f"http_{r.status_code}").inc()
    ctype = r.headers.get("content-type", "application/json")
    return Response(r.content, status_code=r.status_code, media_type=ctype, headers=_headers(b, r))


async def _open_stream(gw: Gateway, b: Backend, path: str, raw: bytes, max_tokens: int) -> Response:
    """Open the upstream stream and read its first bytes before answering, so that a
    backend that fails that early is retried and the client never sees it."""
    assert gw.client is not None
    t0 = time.monotonic()
    req = gw.client.build_request(
        "POST", b.url + path, content=raw, headers={"content-type": "application/json"}
    )
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            gw.release(b)

    try:
        r = await gw.client.send(req, stream=True)
    except httpx.TimeoutException as e:
        release()
        gw.m_requests.labels("http_504").inc()
        raise ApiError(504, f"backend {b.url} timed out", type="server_error") from e
    except httpx.TransportError as e:
        release()
        gw.mark(b, False)
        raise _BackendFailedError(b, e) from e
    if r.status_code != 200:
        try:
            content = await r.aread()
        except httpx.TransportError as e:
            release()
            gw.mark(b, False)
            raise _BackendFailedError(b, e) from e
        finally:
            await r.aclose()
        release()
        gw.m_requests.labels(f"http_{r.status_code}").inc()
        ctype = r.headers.get("content-type", "application/json")
        return Response(
            content, status_code=r.status_code, media_type=ctype, headers=_headers(b, r)
        )
    chunks = r.aiter_raw()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except httpx.TransportError as e:
        await r.aclose()
        release()
        gw.mark(b, False)
        raise _BackendFailedError(b, e) from e
    except BaseException:
        await r.aclose()
        release()
        raise
    ttft = time.monotonic() - t0

    async def relay() -> AsyncIterator[bytes]:
        sent = first
        events = first.count(b"\n\n")
        outcome = "client_gone"
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    sent = chunk
                    events += chunk.count(b"\n\n")
                    yield chunk
                outcome = "ok"
            except httpx.TransportError as e:
                gw.mark(b, False)
                outcome = "failed_midstream"
                msg = (
                    f"backend {b.url} failed mid-stream ({type(e).__name__}); "
                    "the answer is incomplete"
                )
                pad = b"" if not sent or sent.endswith(b"\n\n") else b"\n\n"
                yield pad + _sse_error(msg, b.url) + b"data: [DONE]\n\n"
        finally:
            await r.aclose()
            release()
            gw.m_requests.labels(outcome).inc()
            if outcome == "ok":
                # Events minus role/finish/[DONE]: about one per token on duetime backends.
                tokens = max(1, min(max_tokens, events - 2))
                b.observe(ttft, time.monotonic() - t0, tokens, gw.config.ewma_alpha)

    headers = _headers(b, r)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)
