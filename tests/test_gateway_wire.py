"""The gateway's HTTP/1.1 transport against a real server: answers framed by length and
by chunks, connections kept and reused, a closed one replaced, and httpx's errors
for a refused connection, a silent backend and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from duetime.server.gateway_wire import KeepAliveTransport
from duetime.server.threaded import serve_in_thread

T = TypeVar("T")


def _app(seen: dict[str, object]) -> FastAPI:
    app = FastAPI()
    ends: list[str] = []
    seen["ends"] = ends

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        client = request.client
        return JSONResponse(
            {"body": body.decode(), "port": client.port if client else None},
            headers={"Retry-After": "3"},
        )

    @app.get("/empty")
    async def empty() -> Response:
        return Response(status_code=204)

    @app.get("/stream")
    async def stream(n: int = 3, pause: float = 0.0) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(pause)
                yield b"data: [DONE]\n\n"
            finally:
                ends.append("closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/slow")
    async def slow() -> PlainTextResponse:
        await asyncio.sleep(2.0)
        return PlainTextResponse("late")

    @app.get("/close")
    async def close() -> PlainTextResponse:
        return PlainTextResponse("bye", headers={"Connection": "close"})

    return app


def _run(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(coro_fn())


Server = tuple[str, dict[str, object]]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    seen: dict[str, object] = {}
    with serve_in_thread(_app(seen)) as url:
        yield url, seen


def _client(url: str, timeout: float = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=KeepAliveTransport(), timeout=timeout)


def test_a_whole_answer_keeps_its_connection_for_the_next_request(server: Server) -> None:
    url, _ = server

    async def go() -> list[httpx.Response]:
        async with _client(url) as c:
            return [await c.post("/echo", content=f'{{"i": {i}}}'.encode()) for i in range(3)]

    rs = _run(go)
    assert [r.json()["body"] for r in rs] == ['{"i": 0}', '{"i": 1}', '{"i": 2}']
    assert len({r.json()["port"] for r in rs}) == 1  # one connection for all three
    assert rs[0].headers["retry-after"] == "3"
    assert rs[0].headers["content-type"] == "application/json"


def test_a_chunked_stream_arrives_whole_and_an_empty_answer_has_no_body(server: Server) -> None:
    url, _ = server

    async def go() -> tuple[bytes, int, bytes]:
        async with _client(url) as c:
            async with c.stream("GET", "/stream", params={"n": 4}) as r:
                body = b"".join([chunk async for chunk in r.aiter_raw()])
            e = await c.get("/empty")
            return body, e.status_code, e.content

    body, status, content = _run(go)
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    assert (status, content) == (204, b"")


def test_a_connection_the_server_closed_is_replaced(server: Server) -> None:
    url, _ = server

    async def go() -> tuple[str, str]:
        async with _client(url) as c:
            first = (await c.get("/close")).text
            await asyncio.sleep(0.1)
            return first, (await c.post("/echo", content=b"x")).json()["body"]

    assert _run(go) == ("bye", "x")


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_a_kept_connection_closed_as_the_next_request_arrives_is_sent_again() -> None:
    """The backend's keep-alive timeout can close a kept connection while a request is on
    its way: that request is sent again on a new connection, and answered once."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received: list[bytes] = []

    def backend() -> None:
        first, _ = listener.accept()
        received.append(first.recv(65536))
        first.sendall(_answer(b"one"))
        received.append(first.recv(65536))  # the second request: closed without an answer
        first.close()
        second, _ = listener.accept()
        received.append(second.recv(65536))
        second.sendall(_answer(b"two"))
        second.close()
        listener.close()

    threading.Thread(target=backend, daemon=True).start()

    async def go() -> list[str]:
        async with _client(f"http://127.0.0.1:{port}") as c:
            return [
                (await c.post("/x", content=b"a")).text,
                (await c.post("/x", content=b"b")).text,
            ]

    assert _run(go) == ["one", "two"]
    assert [
        r.endswith(b"\r\n\r\n" + body) for r, body in zip(received, [b"a", b"b", b"b"], strict=True)
    ] == [True] * 3


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def go() -> None:
        async with _client(f"http://127.0.0.1:{port}") as c:
            await c.get("/health")

    with pytest.raises(httpx.ConnectError):
        _run(go)


def test_a_silent_backend_is_a_read_timeout(server: Server) -> None:
    url, _ = server

    async def go() -> None:
        async with _client(url, timeout=0.3) as c:
            await c.get("/slow")

    with pytest.raises(httpx.ReadTimeout):
        _run(go)


def test_a_backend_that_dies_mid_answer_is_a_transport_error() -> None:
    """A server that sends half its declared body and closes: the gateway sees an error,
    not a short answer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def half_answer() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        conn.close()
        listener.close()

    threading.Thread(target=half_answer, daemon=True).start()

    async def go() -> None:
        async with _client(f"http://127.0.0.1:{port}") as c:
            await c.get("/x")

    with pytest.raises(httpx.TransportError):
        _run(go)


def test_a_stream_left_midway_closes_its_connection(server: Server) -> None:
    """The backend must hear that the client left (so it frees the sequence): the
    connection is closed, not kept with half a stream unread."""
    url, seen = server
    ends = seen["ends"]
    assert isinstance(ends, list)
    before = len(ends)

    async def go() -> bytes:
        async with _client(url) as c:
            async with c.stream("GET", "/stream", params={"n": 50, "pause": 0.05}) as r:
                chunks = r.aiter_raw()
                first = await chunks.__anext__()
            for _ in range(40):  # the server notices the close on its next write
                await asyncio.sleep(0.05)
                if len(ends) > before:
                    break
            return first

    assert _run(go).startswith(b"data: 0")
    assert len(ends) == before + 1
