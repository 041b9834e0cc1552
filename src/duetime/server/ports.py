"""TCP ports: the listening socket a server takes before it loads anything, and a free
port for a process started with one.

``duetime serve`` and ``duetime gateway`` bind their socket first (:func:`listening_socket`,
as vLLM's API server does): a port in use is a one-line error at once, not after minutes
of loading the model and timing its steps, the printed URL is the one served, and
clients that connect while the model loads wait in the socket's backlog.

:func:`free_port` picks a free port for a server another process starts: binding port 0
makes the OS pick one; the socket is then closed and that server binds the same port a
moment later. Another process may take it in between: the window is short enough for
the scripts and tests that use it, which start one server each.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["free_port", "listening_socket"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port) for uvicorn to serve on.
    Raises ValueError naming the option where the port is taken or the host is not
    this machine's."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except (socket.gaierror, UnicodeError) as e:  # (gaierror is an OSError: first)
        sock.close()
        raise ValueError(f"--host {host}: not an address of this machine ({e})") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: {host}:{port} is in use (another server?); "
                "choose another, or 0 for any free one"
            ) from None
        why = e.strerror or str(e)
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {why}") from None
    # listening now: the port is this server's from here on (another bound but not yet
    # listening socket would let a second server bind it too), and a client that
    # connects while the model loads waits in the backlog
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (IPv6 for a host with ``:``)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
