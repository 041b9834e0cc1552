"""A streamed answer through the gateway: the upstream stream opened and its first bytes
read before the client is answered (so an early failure can still retry), then relayed
byte for byte, its answer's length read from its last events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import Response, StreamingResponse

from duetime.server.gateway_fleet import Grant
from duetime.server.gateway_pool import Gateway
from duetime.server.gateway_upstream import _failed, _headers, _passed_through
from duetime.server.gateway_wire import transport_words

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


async def _open_stream(gw: Gateway, g: Grant, path: str, raw: bytes, max_tokens: int) -> Response:
    """Open the upstream stream and read its first bytes before answering, so that a
    backend that fails that early is retried and the client never sees it.

    Whatever ends it (an error, the client leaving, the relay finishing), the
    upstream response is closed and the slot given back exactly once.
    """
    assert gw.upstream is not None
    b = g.backend
    t0 = time.monotonic()
    r: httpx.Response | None = None
    closed = False
    b.prefilling += 1
    prefilling = True

    def first_byte() -> None:
        nonlocal prefilling
        if prefilling:
            prefilling = False
            b.prefilling -= 1

    async def close() -> None:
        nonlocal closed
        first_byte()
        if not closed:
            closed = True
            try:
                if r is not None:
                    await r.aclose()
            finally:  # even if closing was cancelled, or the slot would leak
                gw.release(b)

    try:
        r = await gw.upstream.post(b.url + path, raw)
        if r.status_code != 200:  # an error answer is read whole and passed through
            content = await r.aread()
            await close()
            gw.answered(b)
            gw.m_requests.labels(f"http_{r.status_code}").inc()
            return _passed_through(g, r, content)
        chunks = r.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        first_byte()
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
                msg = f"backend {b.url} {how} mid-stream ({transport_words(e)}): answer incomplete"
                pad = b"" if not sent or sent.endswith(b"\n\n") else b"\n\n"
                yield pad + _sse_error(msg, b.url) + b"data: [DONE]\n\n"
        finally:  # count first: under a cancelled client, the await in close() may raise
            gw.m_requests.labels(outcome).inc()
            if outcome == "ok":
                gw.answered(b)
                tokens = stream_tokens(tail)
                if tokens is None:  # one event per token (vLLM), less role / finish / [DONE]
                    tokens = max(1, min(max_tokens, events - 2))
                b.observe(ttft, time.monotonic() - t0, tokens, gw.config.ewma_alpha, g.context)
            await close()

    headers = _headers(g, r)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)
