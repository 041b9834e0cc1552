"""One request on one backend: a whole answer passed through, and what a transport
error there becomes (a 504 for a backend still working on it, else the backend is
down and the request may retry elsewhere)."""

from __future__ import annotations

import time
from contextlib import suppress

import httpx
from fastapi.responses import Response

from duetime.server.errors import ApiError
from duetime.server.gateway_fleet import Grant
from duetime.server.gateway_pool import Gateway
from duetime.server.gateway_routing import Backend
from duetime.server.gateway_wire import transport_words


class _BackendFailedError(Exception):
    def __init__(self, backend: Backend, cause: BaseException) -> None:
        super().__init__(f"backend {backend.url} failed: {transport_words(cause)}")
        self.backend = backend


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
    return ApiError(
        504,
        f"backend {b.url} timed out: {transport_words(e)}",
        type="server_error",
        code="timeout",
    )


def _failed(gw: Gateway, b: Backend, t0: float, e: httpx.TransportError) -> Exception:
    """What a transport error before any byte reached the client becomes: a 504 for a
    backend still working on it, else the backend is down and the request may retry."""
    if _still_working(e):
        return _timed_out(gw, b, time.monotonic() - t0, e)
    gw.mark(b, False)
    return _BackendFailedError(b, e)


def _headers(g: Grant, upstream: httpx.Response) -> dict[str, str]:
    """The backend the answer came from and the forecasts it was routed on (ms after
    the gateway received the request), beside the backend's own ``Retry-After``."""
    h = {
        "X-Duetime-Backend": g.backend.url,
        "X-Duetime-Forecast-Ms": f"{g.forecast_s * 1000:.1f}",
        "X-Duetime-First-Token-Forecast-Ms": f"{g.first_token_s * 1000:.1f}",
    }
    if "retry-after" in upstream.headers:
        h["Retry-After"] = upstream.headers["retry-after"]
    return h


def _passed_through(g: Grant, upstream: httpx.Response, content: bytes) -> Response:
    """A whole upstream answer (any status) for the client, as the backend sent it."""
    ctype = upstream.headers.get("content-type", "application/json")
    return Response(
        content, status_code=upstream.status_code, media_type=ctype, headers=_headers(g, upstream)
    )


async def _whole(gw: Gateway, g: Grant, path: str, raw: bytes, max_tokens: int) -> Response:
    assert gw.upstream is not None
    b = g.backend
    t0 = time.monotonic()
    try:
        r = await gw.upstream.post(b.url + path, raw)
        try:
            content = await r.aread()
        finally:
            await r.aclose()
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
            ttft_s = None if ttft_ms is None else ttft_ms / 1000.0
            b.observe(ttft_s, e2e, tokens, gw.config.ewma_alpha, g.context)
        gw.m_requests.labels("ok").inc()
    else:
        gw.m_requests.labels(f"http_{r.status_code}").inc()
    return _passed_through(g, r, content)
