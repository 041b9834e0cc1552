"""A connection without whole request headers is closed with a 408 after the header timeout.

uvicorn alone kept such a connection (nothing sent, or half a request line or
headers) open until the server stopped; these tests time out on it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.server.header_timeout import header_timeout_protocol
from duetime.server.threaded import serve_in_thread
from tests.served import no_serving

TIMEOUT_S = 0.3
SLOW_S = 1.0  # longer than the header timeout: work after the headers must not be cut


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers after reading the whole body; /slow waits ``SLOW_S`` first."""
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    answer = b"ok:" + body
    length = [(b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": length})
    await send({"type": "http.response.body", "body": answer})


@contextmanager
def _connected() -> Iterator[socket.socket]:
    with serve_in_thread(_app, header_timeout_s=TIMEOUT_S) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            yield conn


def _read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and how long that took."""
    t0 = time.monotonic()
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    return data, time.monotonic() - t0


def _read_response(conn: socket.socket, body: bytes) -> bytes:
    """The bytes of one response, read until its ``body`` has come (the app's answers
    carry what they read, so each test knows its whole body)."""
    data = b""
    while not data.endswith(body):
        chunk = conn.recv(4096)
        assert chunk, f"closed before the response: {data!r}"
        data += chunk
    return data


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/comp", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
    ids=["nothing", "half a request line", "half the headers"],
)
def test_a_connection_without_whole_headers_is_closed_with_a_408(sent: bytes) -> None:
    with _connected() as conn:
        conn.sendall(sent)
        data, took = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert b"Connection: close" in data
    assert data.endswith(f"request headers not received within {TIMEOUT_S:g} s\n".encode())
    assert took < 5  # the timeout, not the socket's 10 s or the server's stop


def test_the_next_request_on_a_kept_alive_connection_gets_the_same_bound() -> None:
    with _connected() as conn:
        conn.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(conn, b"ok:").startswith(b"HTTP/1.1 200 ")
        conn.sendall(b"GET /b HTTP/1.1\r\nHost:")
        data, took = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert took < 3  # not uvicorn's 5 s keep-alive timeout


def test_headers_sent_slowly_but_in_time_are_served() -> None:
    with _connected() as conn:
        for part in (b"POST / HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Length: 2\r\n\r\n"):
            conn.sendall(part)
            time.sleep(TIMEOUT_S / 4)
        conn.sendall(b"hi")
        assert _read_response(conn, b"ok:hi").startswith(b"HTTP/1.1 200 ")


def test_what_follows_the_headers_is_not_bounded_by_the_header_timeout() -> None:
    with _connected() as conn:
        # a body that arrives after the header timeout, then an answer that takes longer
        conn.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        time.sleep(2 * TIMEOUT_S)
        conn.sendall(b"cd")
        response = _read_response(conn, b"ok:abcd")
    assert response.startswith(b"HTTP/1.1 200 ")


def test_a_header_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="header timeout should be > 0 s"):
        header_timeout_protocol(0)


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_the_commands_serve_with_their_header_timeout(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from duetime.cli import app

    ran = no_serving(monkeypatch)
    if command == "serve":  # the command sets torch's threads: leave this process's be
        args = ["serve", "--model", "tiny", "--predictor", "none"]
        args += ["--threads", str(torch.get_num_threads())]
    else:
        args = ["gateway", "--backend", "http://127.0.0.1:9"]
    result = CliRunner().invoke(app, [*args, "--port", "0", "--header-timeout", "4.5"])
    assert result.exit_code == 0, result.output
    assert ran["config"].http.header_timeout_s == 4.5
    result = CliRunner().invoke(app, [*args, "--port", "0", "--header-timeout", "0"])
    assert result.exit_code == 2


def _closed_for_late_headers(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /metr")
        data, _ = _read_until_closed(conn)
    assert data.startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("server", ["serve", "gateway"])
def test_a_header_timeout_close_is_counted_in_metrics(server: str) -> None:
    """No request reached the app, so /metrics did not count these closes at all."""
    import httpx

    from duetime.server.app import create_app
    from duetime.server.gateway import GatewayConfig, create_gateway_app
    from tests.factories import prometheus_samples
    from tests.served import char_state

    if server == "serve":
        app = create_app(char_state())
        sample = 'duetime_http_responses_total{route="other",status="408"}'
    else:
        app = create_gateway_app(["http://127.0.0.1:9"], GatewayConfig(health_interval_s=60))
        sample = 'duetime_gateway_requests_total{outcome="http_408"}'
    with serve_in_thread(app, header_timeout_s=TIMEOUT_S) as url:
        _closed_for_late_headers(url)
        _closed_for_late_headers(url)
        counts = prometheus_samples(httpx.get(f"{url}/metrics", timeout=10).text)
    assert counts.get(sample) == 2.0
