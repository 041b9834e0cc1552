"""`duetime gateway`: duetime's policies in front of several OpenAI-compatible backends.

The gateway does not generate. It admits, orders and routes requests to
backends (``duetime serve`` processes, or a vLLM/SGLang fleet) and passes their
answers, streamed or whole, through byte for byte.

This module is the HTTP side (parsing, forwarding, streaming relay, failures);
the routing rule and per-backend estimates are in :mod:`.gateway_routing`, the
slots, wait queue, health and metrics in :mod:`.gateway_pool`.

* **Routing**: each backend keeps its in-flight count and EWMAs of the time to
  first token and the seconds per output token seen on completed answers; the
  predicted finish of a new request there is ``(in_flight + 1) * (ttft +
  tpot * max_tokens)``. The request goes to the backend with the earliest one.
* **Admission**: a request whose ``deadline_ms`` no backend is predicted to meet
  is refused at once with 429 and ``Retry-After``.
* **Ordering**: when every backend is at ``max_inflight``, requests wait in a
  queue ordered by absolute deadline (then priority, then arrival).
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
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from duetime.server.body_fields import MAX_MS, MAX_TOKENS_LIMIT
from duetime.server.errors import ApiError, BodyLimit, install_error_handlers
from duetime.server.gateway_pool import Gateway, model_ids
from duetime.server.gateway_routing import Backend, GatewayConfig, choose_backend, routable
from duetime.server.paths import StripTrailingSlash

__all__ = [
    "Backend",
    "Gateway",
    "GatewayConfig",
    "choose_backend",
    "create_gateway_app",
    "routable",
]

log = logging.getLogger("duetime.gateway")

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class _BackendFailedError(Exception):
    def __init__(self, backend: Backend, cause: BaseException) -> None:
        super().__init__(f"backend {backend.url} failed: {type(cause).__name__}: {cause}")
        self.backend = backend


# --- the app ----------------------------------------------------------------------------
def _request_fields(body: Any, chat: bool) -> tuple[int, float | None, int, str | None, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        mt = 256 if chat else _DEFAULT_MAX_TOKENS
    if mt > MAX_TOKENS_LIMIT:  # the backend refuses it too; here it would overflow the estimate
        raise ApiError(400, f"max_tokens must be <= {MAX_TOKENS_LIMIT}", param="max_tokens")
    ms = body.get("deadline_ms", body.get("time_budget_ms"))
    if isinstance(ms, int | float) and not isinstance(ms, bool) and ms > MAX_MS:
        raise ApiError(400, f"deadline_ms must be <= {MAX_MS:.0f}", param="deadline_ms")
    deadline = float(ms) / 1000.0 if isinstance(ms, int | float) and ms > 0 else None
    prio = body.get("priority", 0)
    prio = prio if isinstance(prio, int) and not isinstance(prio, bool) else 0
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return mt, deadline, prio, model, bool(body.get("stream", False))


_TAIL_BYTES = 8192  # the end of a stream, where its usage / duetime summary event sits


def stream_tokens(tail: bytes) -> int | None:
    """The answer's length from the last events of a stream, if they say it.

    ``usage.completion_tokens`` (when the client asked for usage) or duetime's
    ``duetime.completion_tokens``; a duetime backend sends one event per batch
    of tokens, not per token, so counting events would make it look ~30x slower.
    """
    for line in reversed(tail.split(b"\n")):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[len(b"data: ") :])
        except ValueError:
            continue  # the first line of the tail may be cut
        for box in (event.get("usage"), event.get("duetime")):
            n = box.get("completion_tokens") if isinstance(box, dict) else None
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                return n
    return None


def _sse_error(message: str, backend: str) -> bytes:
    err = {"message": message, "type": "server_error", "param": None, "code": "backend_failed"}
    err["backend"] = backend
    return b"data: " + json.dumps({"error": err}).encode() + b"\n\n"


def create_gateway_app(
    backends: list[str],
    config: GatewayConfig | None = None,
    profiles: dict[str, dict[str, float]] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The gateway's ASGI app in front of ``backends`` (base URLs, without ``/v1``).

    ``transport`` replaces the network (tests put fake backends behind it); its
    requests still carry the configured timeouts in ``request.extensions``.
    """
    gw = Gateway(backends, config, profiles)
    cfg = gw.config

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        n = max(16, cfg.max_inflight * len(gw.backends) * 2)
        gw.client = httpx.AsyncClient(
            trust_env=False,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            transport=transport,
        )
        await asyncio.gather(*(gw.probe(b) for b in gw.backends), return_exceptions=True)
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
                        "suspect": b.suspect_until > 0,
                        "timeouts": b.timeouts,
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
                for d in model_ids(r.json()):
                    seen.setdefault(d["id"], d)
            except (httpx.HTTPError, ValueError):
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
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        max_tokens, deadline, prio, model, stream = _request_fields(body, chat)
    except ApiError as e:  # a refused body is an outcome too: /metrics counts every request
        gw.m_requests.labels(f"http_{e.status}").inc()
        raise
    t0 = time.monotonic()
    tried: set[str] = set()
    last: _BackendFailedError | None = None
    for _attempt in range(2):  # one retry on another backend, only while nothing was sent
        left = None if deadline is None else deadline - (time.monotonic() - t0)
        if left is not None and left <= 0:
            break
        try:
            b = await _unless_client_leaves(
                request, gw.acquire(max_tokens, left, prio, model, frozenset(tried))
            )
        except _ClientGoneError:
            gw.m_requests.labels("client_gone").inc()
            return Response(status_code=499)
        except ApiError as e:
            if last is not None:
                break
            gw.m_requests.labels(f"http_{e.status}").inc()
            raise
        tried.add(b.url)
        if last is not None:
            gw.m_retries.inc()
        try:
            send = _open_stream if stream else _whole
            return await _unless_client_leaves(request, send(gw, b, path, raw, max_tokens))
        except _ClientGoneError:  # the cancellation closed the upstream request
            gw.m_requests.labels("client_gone").inc()
            return Response(status_code=499)
        except _BackendFailedError as e:
            last = e
            continue
    gw.m_requests.labels("failed").inc()
    msg = str(last) if last is not None else "the deadline passed before a retry"
    raise ApiError(502, msg, type="server_error", code="backend_failed")


class _ClientGoneError(Exception):
    """The client disconnected while its request waited or ran upstream."""


async def _unless_client_leaves(request: Request, work: Any, poll_s: float = 0.25) -> Any:
    """Await ``work``, cancelling it (which closes an upstream request) if the client leaves.

    Starlette tells a handler about a disconnect only when asked, so it is polled.
    Work that completes although it was cancelled returns (or raises) as usual:
    the caller goes on, sends to a client that is gone, and counts one outcome.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})
                if task.cancelled():
                    raise _ClientGoneError
                # It finished meanwhile: its result stands, since dropping it would drop
                # a backend slot (acquire) or count an answered request twice (_whole).
                return task.result()
    except BaseException:
        task.cancel()
        raise


def _still_working(e: httpx.TransportError) -> bool:
    """A timeout after the request reached the backend, which may still be working on it.

    Such a request is not retried and its backend not marked down. A connect
    timeout is not one: nothing reached the backend, as with a refused
    connection, so retrying elsewhere is safe.
    """
    return isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout)


def _timed_out(gw: Gateway, b: Backend, elapsed_s: float, e: Exception) -> ApiError:
    """A backend timeout: 504, not retried and not marked down; its estimate learns it is slow."""
    gw.m_requests.labels("http_504").inc()
    b.observe(None, elapsed_s, 1, gw.config.ewma_alpha)
    gw.timed_out(b)
    return ApiError(504, f"backend {b.url} timed out ({type(e).__name__})", type="server_error")


def _failed(gw: Gateway, b: Backend, t0: float, e: httpx.TransportError) -> Exception:
    """What a transport error before any byte reached the client becomes: a 504 for a
    backend still working on it, else the backend is down and the request may retry."""
    if _still_working(e):
        return _timed_out(gw, b, time.monotonic() - t0, e)
    gw.mark(b, False)
    return _BackendFailedError(b, e)


def _headers(b: Backend, upstream: httpx.Response) -> dict[str, str]:
    h = {"X-Duetime-Backend": b.url}
    if "retry-after" in upstream.headers:
        h["Retry-After"] = upstream.headers["retry-after"]
    return h


def _passed_through(b: Backend, upstream: httpx.Response, content: bytes) -> Response:
    """A whole upstream answer (any status) for the client, as the backend sent it."""
    ctype = upstream.headers.get("content-type", "application/json")
    return Response(
        content, status_code=upstream.status_code, media_type=ctype, headers=_headers(b, upstream)
    )


async def _whole(gw: Gateway, b: Backend, path: str, raw: bytes, max_tokens: int) -> Response:
    assert gw.client is not None
    t0 = time.monotonic()
    try:
        r = await gw.client.post(
            b.url + path, content=raw, headers={"content-type": "application/json"}
        )
    except httpx.TransportError as e:
        raise _failed(gw, b, t0, e) from e
    finally:
        gw.release(b)
    e2e = time.monotonic() - t0
    gw.answered(b)
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
    return _passed_through(b, r, r.content)


async def _open_stream(gw: Gateway, b: Backend, path: str, raw: bytes, max_tokens: int) -> Response:
    """Open the upstream stream and read its first bytes before answering, so that a
    backend that fails that early is retried and the client never sees it.

    Whatever ends it (an error, the client leaving, the relay finishing), the
    upstream response is closed and the slot given back exactly once.
    """
    assert gw.client is not None
    t0 = time.monotonic()
    req = gw.client.build_request(
        "POST", b.url + path, content=raw, headers={"content-type": "application/json"}
    )
    r: httpx.Response | None = None
    closed = False

    async def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            try:
                if r is not None:
                    await r.aclose()
            finally:  # even if closing was cancelled, or the slot would leak
                gw.release(b)

    try:
        r = await gw.client.send(req, stream=True)
        if r.status_code != 200:  # an error answer is read whole and passed through
            content = await r.aread()
            await close()
            gw.answered(b)
            gw.m_requests.labels(f"http_{r.status_code}").inc()
            return _passed_through(b, r, content)
        chunks = r.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
    except httpx.TransportError as e:
        err = _failed(gw, b, t0, e)  # first: the slot freed next must not go to b if it hangs
        await close()
        raise err from e
    except BaseException:  # the client left (cancelled) before the first byte
        await close()
        raise
    ttft = time.monotonic() - t0
    assert r is not None

    async def relay() -> AsyncIterator[bytes]:
        sent = first
        tail = first[-_TAIL_BYTES:]
        events = first.count(b"\n\n")
        outcome = "client_gone"
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    sent = chunk
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                    events += chunk.count(b"\n\n")
                    yield chunk
                outcome = "ok"
            except httpx.TransportError as e:
                timeout = isinstance(e, httpx.TimeoutException)
                if timeout:  # a slow backend is not a dead one, but it may be hanging
                    gw.timed_out(b)
                else:
                    gw.mark(b, False)
                outcome = "timeout_midstream" if timeout else "failed_midstream"
                how = "timed out" if timeout else "failed"
                msg = f"backend {b.url} {how} mid-stream ({type(e).__name__}): answer incomplete"
                pad = b"" if not sent or sent.endswith(b"\n\n") else b"\n\n"
                yield pad + _sse_error(msg, b.url) + b"data: [DONE]\n\n"
        finally:  # count first: under a cancelled client, the await in close() may raise
            gw.m_requests.labels(outcome).inc()
            if outcome == "ok":
                gw.answered(b)
                tokens = stream_tokens(tail)
                if tokens is None:  # one event per token (vLLM), less role / finish / [DONE]
                    tokens = max(1, min(max_tokens, events - 2))
                b.observe(ttft, time.monotonic() - t0, tokens, gw.config.ewma_alpha)
            await close()

    headers = _headers(b, r)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)
