"""In-process fakes for gateway tests: misbehaving backends and an ASGI client.

``FakeFleet`` is an ``httpx`` transport that the gateway's client talks to
(``create_gateway_app(..., transport=fleet)``); each ``FakeBackend`` answers
``/health``, ``/v1/models`` and completions, streamed or whole, following a
script of ``Fate``s, and records every request it got, every byte it sent and
how many requests it held at once. A hang lasts the read timeout the gateway
gave the request, as a real socket would, and then raises ``ReadTimeout``.

``call`` drives the gateway's ASGI app as uvicorn does (ASGI spec 2.3: after
the client left, ``receive`` says ``http.disconnect`` and ``send`` is dropped),
so a client can leave at any moment without cancelling the handler.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

MODEL = "m"
_arrivals = itertools.count()  # orders attempts across backends

#: What a backend does with one request: answer ("ok"), refuse the connection
#: or let it time out, close it before the headers ("break_before") or after
#: ``after`` pieces of the body ("break_midway"), hang before the headers or
#: after ``after`` pieces, or answer ``status`` with a JSON error body, whole,
#: broken or stalled after its first piece.
KINDS = (
    "ok",
    "connect_error",
    "connect_timeout",
    "break_before",
    "break_midway",
    "hang_before",
    "hang_midway",
    "status",
    "status_broken",
    "status_stalled",
)


@dataclass(frozen=True, slots=True)
class Fate:
    kind: str = "ok"
    status: int = 500
    after: int = 1  # pieces sent before a midway break or hang


@dataclass(slots=True)
class Attempt:
    """One request as a backend saw it."""

    rid: int
    backend: str
    fate: str
    stream: bool
    raw: bytes
    sent: bytearray = field(default_factory=bytearray)  # body bytes the backend produced
    status: int | None = None
    open: bool = True  # the gateway has not closed it yet
    finished: bool = False  # the whole body was sent
    failed: str | None = None  # "refused", "connect timeout", "broke" or "timed out"
    seq: int = field(default_factory=lambda: next(_arrivals))


@dataclass
class FakeBackend:
    name: str  # host part of its URL: http://<name>
    fates: list[Fate] = field(default_factory=lambda: [Fate()])
    latency_s: float = 0.0  # before the headers
    gap_s: float = 0.0  # between body pieces
    tokens: int = 4
    pieces: int = 3  # a body is cut into this many pieces (not on event boundaries)
    down: tuple[float, float] | None = None  # seconds after start when it is dead
    gate: asyncio.Event | None = None  # if set, answers wait for it (tests order events)
    hang: bool = False  # while True, every completion hangs (health stays fine)
    shield_close: bool = True  # False: closing a body can be cancelled (httpcore shields it)
    metrics: str | None = None  # its /metrics text; None: duetime serve's, from its state
    attempts: list[Attempt] = field(default_factory=list)
    current: int = 0
    peak: int = 0
    t0: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://{self.name}"

    def is_down(self) -> bool:
        if self.down is None:
            return False
        t = time.monotonic() - self.t0
        return self.down[0] <= t < self.down[1]

    def _enter(self, att: Attempt) -> None:
        self.attempts.append(att)
        self.current += 1
        self.peak = max(self.peak, self.current)

    def _leave(self, att: Attempt) -> None:
        if att.open:
            att.open = False
            self.current -= 1

    async def complete(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        fate = self.fates[len(self.attempts) % len(self.fates)]
        if self.hang:
            fate = Fate("hang_before")
        stream = bool(body.get("stream"))
        att = Attempt(body.get("rid", -1), self.url, fate.kind, stream, request.content)
        self._enter(att)
        read_timeout = request.extensions.get("timeout", {}).get("read") or 600.0
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.latency_s)
            if self.is_down() or fate.kind == "connect_error":
                att.failed = "refused"
                raise httpx.ConnectError("connection refused", request=request)
            if fate.kind == "connect_timeout":
                att.failed = "connect timeout"
                raise httpx.ConnectTimeout("no answer to SYN", request=request)
            if fate.kind == "break_before":
                att.failed = "broke"
                raise httpx.RemoteProtocolError("closed before the headers", request=request)
            if fate.kind == "hang_before":
                await asyncio.sleep(read_timeout)
                att.failed = "timed out"
                raise httpx.ReadTimeout("no headers", request=request)
        except BaseException:
            self._leave(att)
            raise
        if fate.kind.startswith("status"):
            err = {"error": {"message": f"{self.name} says {fate.status}", "code": fate.status}}
            payload = json.dumps(err).encode()
            att.status = fate.status
            headers = {"content-type": "application/json"}
            if fate.status in (429, 503):
                headers["retry-after"] = "3"
            pieces = [payload[:9], payload[9:]]
            then = {"status_broken": "break_midway", "status_stalled": "hang_midway"}
            fate = Fate(then.get(fate.kind, "ok"), after=1)
            return self._respond(att.status, headers, att, pieces, fate, read_timeout)
        att.status = 200
        full = self._body(body, request.url.path, stream, att)
        cut = max(1, len(full) // self.pieces)
        pieces = [full[i : i + cut] for i in range(0, len(full), cut)]
        ctype = "text/event-stream" if stream else "application/json"
        return self._respond(200, {"content-type": ctype}, att, pieces, fate, read_timeout)

    def _body(self, body: dict[str, Any], path: str, stream: bool, att: Attempt) -> bytes:
        rid = f"{self.name}-{att.rid}-{len(self.attempts)}"
        chat = path.endswith("/chat/completions")
        n = min(self.tokens, int(body.get("max_tokens") or self.tokens))

        def choice(i: int, last: bool) -> dict[str, Any]:
            text = f"t{i} "
            c: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                c["delta" if stream else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            return c

        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if not stream:
            whole = {"id": rid, "choices": [choice(0, True)], "usage": usage}
            return json.dumps(whole).encode()
        events = [{"id": rid, "choices": [choice(i, i == n - 1)]} for i in range(n)]
        events.append({"id": rid, "choices": [], "usage": usage})
        out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return out + b"data: [DONE]\n\n"

    def _respond(
        self,
        status: int,
        headers: dict[str, str],
        att: Attempt,
        pieces: list[bytes],
        fate: Fate | None,
        read_timeout: float,
    ) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                if fate is not None and i == fate.after and i > 0:
                    if fate.kind == "break_midway":
                        att.failed = "broke"
                        raise httpx.ReadError("connection reset mid-body")
                    if fate.kind == "hang_midway":
                        await asyncio.sleep(read_timeout)
                        att.failed = "timed out"
                        raise httpx.ReadTimeout("stalled mid-body")
                if i > 0:
                    await asyncio.sleep(self.gap_s)
                if self.is_down():
                    att.failed = "broke"
                    raise httpx.ReadError("the backend died mid-body")
                att.sent += piece
                yield piece
            att.finished = True

        return httpx.Response(
            status,
            headers=headers,
            stream=_Stream(body(), lambda: self._leave(att), self.shield_close),
        )


class _Stream(httpx.AsyncByteStream):
    """A response body that tells its backend when the gateway closed it."""

    def __init__(
        self, gen: AsyncIterator[bytes], on_close: Callable[[], None], shield: bool = True
    ) -> None:
        self._gen = gen
        self._on_close = on_close
        self._shield = shield

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._gen:
            yield piece

    async def aclose(self) -> None:
        self._on_close()
        with anyio.CancelScope(shield=self._shield):  # as httpcore shields closing a connection
            await self._gen.aclose()  # type: ignore[attr-defined]
            await asyncio.sleep(0)  # closing a socket yields to the loop, as anyio's does


class FakeFleet(httpx.AsyncBaseTransport):
    """Routes the gateway's requests to fake backends by host name."""

    def __init__(self, backends: list[FakeBackend]) -> None:
        self.by_host = {b.name: b for b in backends}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        b = self.by_host[request.url.host]
        if request.url.path == "/health":
            if b.is_down():
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        if request.url.path == "/metrics":
            if b.is_down():
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(200, text=b.metrics or duetime_metrics(b.current, 0, 0))
        return await b.complete(request)


def duetime_metrics(running: int, waiting: int, kv_used: int, kv_capacity: int = 4096) -> str:
    """The gauges ``duetime serve`` publishes (src/duetime/server/metrics.py), as it writes them."""
    return (
        f"# TYPE duetime_queue_length gauge\nduetime_queue_length {waiting}.0\n"
        f"# TYPE duetime_running gauge\nduetime_running {running}.0\n"
        "# TYPE duetime_suspended gauge\nduetime_suspended 0.0\n"
        f"# TYPE duetime_kv_used_tokens gauge\nduetime_kv_used_tokens {kv_used}.0\n"
        f"# TYPE duetime_kv_capacity_tokens gauge\nduetime_kv_capacity_tokens {kv_capacity}.0\n"
    )


# --- the client side ------------------------------------------------------------------
@dataclass
class Seen:
    """What one client got from the gateway."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False  # the last body message arrived before the client left
    left: bool = False  # the client hung up before its answer was complete
    error: BaseException | None = None  # the app raised

    def json(self) -> Any:
        return json.loads(bytes(self.body))


async def call(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"",
    leave_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> Seen:
    """One HTTP request to an ASGI app, as uvicorn would pass it; the client may leave.
    ``headers`` add to, or replace, a JSON request's host and content type."""
    seen = Seen()
    wake = asyncio.Event()  # the answer is complete or the client is gone
    gone = False
    asked = False
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (k.lower().encode(), v.encode())
            for k, v in {
                "host": "gateway",
                "content-type": "application/json",
                **(headers or {}),
            }.items()
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await wake.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone:
            return
        if message["type"] == "http.response.start":
            seen.status = message["status"]
            seen.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            seen.body += message.get("body", b"")
            if not message.get("more_body", False):
                seen.complete = True
                wake.set()

    def leave() -> None:
        nonlocal gone
        if not seen.complete:
            gone = seen.left = True
            wake.set()

    timer = None
    if leave_after_s is not None:
        timer = asyncio.get_running_loop().call_later(leave_after_s, leave)
    try:
        await app(scope, receive, send)
    except Exception as e:  # an exception out of the app is itself a finding
        seen.error = e
    finally:
        if timer is not None:
            timer.cancel()
    return seen
