"""Run an ASGI app under uvicorn on a background thread (tests, benchmarks, demos).

The port is chosen by the OS (bind to port 0) and read back from the socket,
so parallel test workers never collide.
"""

from __future__ import annotations

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

__all__ = ["serve_in_thread"]


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
        http=header_timeout_protocol(header_timeout_s, on_close_of(app)),
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
