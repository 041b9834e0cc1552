"""Run an ASGI app under uvicorn as duetime does: in the foreground (``duetime serve``,
``duetime gateway``: :func:`run_server`) or on a background thread (tests, benchmarks,
demos: :func:`serve_in_thread`).

Both use the same HTTP protocol, the h11 one with a header timeout whose closes
the app counts (:mod:`duetime.server.header_timeout`). In a thread the port is
chosen by the OS (bind to port 0) and read back from the socket, so parallel
test workers never collide.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from duetime.server.header_timeout import (
    DEFAULT_HEADER_TIMEOUT_S,
    header_timeout_protocol,
    on_close_of,
)

__all__ = ["run_server", "serve_in_thread"]


def _http(app: Any, header_timeout_s: float) -> type:
    """The protocol class: late headers close the connection, counted by ``app``."""
    return header_timeout_protocol(header_timeout_s, on_close_of(app))


def run_server(
    app: Any,
    *,
    sock: socket.socket,
    log_level: str,
    shutdown_timeout_s: int,
    header_timeout_s: float,
) -> None:
    """Serve ``app`` in the foreground on the bound ``sock`` (:func:`listening_socket`)
    until SIGTERM / Ctrl-C; exits 3, as ``uvicorn.run`` does, if it never started."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout_s,
        http=_http(app, header_timeout_s),
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)


@contextmanager
def serve_in_thread(
    app: Any,
    host: str = "127.0.0.1",
    timeout_s: float = 30.0,
    log_level: str = "warning",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> Iterator[str]:
    """Serve ``app``; yields its base URL (``http://127.0.0.1:PORT``); stops on exit.

    It runs the HTTP protocol ``duetime serve`` runs (:mod:`duetime.server.header_timeout`).
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=0,
        log_level=log_level,
        lifespan="on",
        http=_http(app, header_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
