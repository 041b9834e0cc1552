"""A free TCP port, for a server that must print its URL before it serves.

Binding port 0 makes the OS pick a free port, and reading it back gives the port;
the socket is then closed and the server binds the same port a moment later. Another
process may take it in between: the window is short enough for the commands and tests
that use this, which start one server each.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (IPv6 for a host with ``:``)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
