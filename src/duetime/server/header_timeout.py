"""Close a connection whose request headers do not arrive in time (slowloris).

uvicorn's HTTP/1.1 protocol times out only a kept-alive connection that sits
idle after a response. A client that connects and sends nothing, or part of a
request line or of its headers, holds the connection, its socket and a
protocol object until the server stops, and many such clients exhaust the
process's file descriptors. Once the headers are in, the app's own guards
take over (``BodyLimit``: a body not complete in time is a 408).

:func:`header_timeout_protocol` gives uvicorn an ``http=`` protocol class that
starts a timer whenever the connection waits for a request's headers (on
connect, and when a kept-alive connection's next request begins) and stops it
once they are parsed. On expiry it writes a bare 408 with ``Connection:
close`` and closes the connection, as nginx's ``client_header_timeout`` does.
It extends uvicorn's h11 protocol (the one uvicorn picks without
``httptools``), so it reads that class's ``cycle``, ``transport`` and ``loop``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "header_timeout_protocol", "on_close_of"]

DEFAULT_HEADER_TIMEOUT_S = 30.0
_log = logging.getLogger("uvicorn.error")


def header_timeout_protocol(
    timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, on_close: Callable[[], None] | None = None
) -> type[H11Protocol]:
    """An h11 protocol class that closes a connection after ``timeout_s`` s without
    complete request headers (pass it as ``uvicorn.run(..., http=...)``).

    ``on_close`` is called for each such close: no request reached the app, so
    this is how its /metrics can count them (:func:`on_close_of`).
    """
    if not timeout_s > 0:
        raise ValueError(f"header timeout should be > 0 s, got {timeout_s}")
    reply = (
        b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
    )
    body = f"request headers not received within {timeout_s:g} s\n".encode()

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout_s = timeout_s
        _header_timer: asyncio.TimerHandle | None = None

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_timer(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self._awaiting_headers() or self.transport.is_closing():
                return
            who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            _log.warning(
                "%s sent no whole request headers within %g s: closed with a 408", who, timeout_s
            )
            self.transport.write(reply % (len(body), body))
            self.transport.close()
            if on_close is not None:
                on_close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_timer()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._awaiting_headers():
                # a kept-alive connection's next request begins (uvicorn stops its
                # idle timer on this data): its headers get the same bound
                self._start_timer()
            super().data_received(data)
            if not self._awaiting_headers():
                self._stop_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def on_close_of(app: Any) -> Callable[[], None] | None:
    """The counter an app offers for header-timeout closes (``app.state.on_header_timeout``),
    or None: ``duetime serve`` and the gateway set one, a bare ASGI app has none."""
    return getattr(getattr(app, "state", None), "on_header_timeout", None)
