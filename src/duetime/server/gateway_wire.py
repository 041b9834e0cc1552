"""HTTP/1.1 to the backends for the gateway's ``httpx`` client: kept-alive connections,
each request written in one send.

Why not httpx's own transport (httpcore over anyio): behind the no-op backend of
``duetime bench serve`` its per-request work (pool locks, anyio stream attributes
looked up on every reuse, trace hooks, h11 events) was ~30 % of the gateway
thread's CPU time, and it writes a request's head and body in two sends, so a
backend wakes up once for the head alone. This transport keeps, per backend, the
connections whose last answer ended cleanly, and frames answers by
``Content-Length``, ``chunked`` or the connection's end.

It raises ``httpx``'s exceptions, as the gateway's failure handling expects: a
refused or reset connect is :class:`httpx.ConnectError`, a late one
:class:`httpx.ConnectTimeout`, a backend silent past the read timeout
:class:`httpx.ReadTimeout`, a connection that breaks or closes mid-answer
:class:`httpx.ReadError` / :class:`httpx.RemoteProtocolError`. A kept connection
the backend closed before any byte of the answer (its keep-alive timeout) is
replaced by a new one, once. Other schemes (``https``) go to httpx's transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import suppress

import httpx

__all__ = ["KeepAliveTransport", "Upstream"]

_HEAD_LIMIT = 64 * 1024  # an answer's status line and headers
_READ = 64 * 1024
_NO_BODY = frozenset({204, 304})


def _said(e: BaseException) -> str:
    """An OS or parse error in words for a client: its reason ("Connection reset by peer"),
    not the Python class it came as."""
    return getattr(e, "strerror", None) or str(e) or "the connection failed"


def transport_words(e: BaseException) -> str:
    """What went wrong on the wire, as a client reads it in an error: the transport's own
    words, else what the kind of error means (its class name told a client nothing)."""
    said = str(e)
    if said:
        return said
    for kind, words in (
        (httpx.ConnectTimeout, "no connection in time"),
        (httpx.TimeoutException, "no answer in time"),
        (httpx.ConnectError, "the connection was refused"),
        (httpx.RemoteProtocolError, "the answer broke HTTP"),
    ):
        if isinstance(e, kind):
            return words
    return "the connection failed"


class _UnansweredError(httpx.RemoteProtocolError):
    """The connection closed or reset before any byte of the answer: on a kept one, the
    backend's keep-alive timeout (the request is sent again on a new connection)."""


def _head_error(e: BaseException) -> BaseException:
    """The httpx error for what ended a request before its answer's head was read."""
    if isinstance(e, TimeoutError):
        return httpx.ReadTimeout("no answer within the timeout")
    if isinstance(e, asyncio.IncompleteReadError):
        if e.partial:
            return httpx.RemoteProtocolError("the backend closed the connection mid-answer")
        return _UnansweredError("the backend closed the connection without answering")
    if isinstance(e, ConnectionResetError | BrokenPipeError):
        return _UnansweredError(_said(e))
    if isinstance(e, OSError):
        return httpx.ReadError(_said(e))
    if isinstance(e, asyncio.LimitOverrunError | ValueError):
        return httpx.RemoteProtocolError("the answer's head is too long")
    return e


class _Conn:
    """One TCP connection to a backend."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        """Still open: the backend has not closed it (its keep-alive timeout) since."""
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()


class _Body(httpx.AsyncByteStream):
    """An answer's body as it arrives; the connection goes back to the pool only when
    the body was read to its end and the backend keeps the connection open."""

    def __init__(
        self,
        owner: KeepAliveTransport,
        key: tuple[str, int],
        conn: _Conn,
        length: int | None,
        chunked: bool,
        keep: bool,
        read_s: float | None,
    ) -> None:
        self._owner = owner
        self._key = key
        self._conn = conn
        self._length = length  # None: until the connection closes (or chunked)
        self._chunked = chunked
        self._keep = keep and (chunked or length is not None)
        self._read_s = read_s
        self._done = False
        self._released = False

    async def _read(self, op: Awaitable[bytes]) -> bytes:
        try:
            async with asyncio.timeout(self._read_s):
                return await op
        except TimeoutError:
            raise httpx.ReadTimeout("the backend sent nothing within the read timeout") from None
        except asyncio.IncompleteReadError:
            raise httpx.RemoteProtocolError("the connection closed mid-answer") from None
        except (OSError, asyncio.LimitOverrunError, ValueError) as e:
            raise httpx.ReadError(_said(e)) from e

    async def __aiter__(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        if self._chunked:
            while True:
                size_line = await self._read(r.readuntil(b"\r\n"))
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("a malformed chunk size") from None
                if size == 0:
                    while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":
                        pass  # trailers, ignored
                    break
                data = await self._read(r.readexactly(size + 2))
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await self._read(r.read(min(left, _READ)))
                if not data:
                    raise httpx.RemoteProtocolError("the backend closed the connection mid-answer")
                left -= len(data)
                yield data
        else:
            while data := await self._read(r.read(_READ)):
                yield data
        self._done = True

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        if self._done and self._keep and self._conn.usable():
            self._owner._put(self._key, self._conn)
        else:  # a body left unread: closing tells the backend its client left
            self._conn.close()


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """Plain-HTTP/1.1 transport with per-backend kept-alive connections (see the module)."""

    def __init__(self, max_idle_per_backend: int = 64) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._max_idle = max_idle_per_backend
        self._fallback: httpx.AsyncHTTPTransport | None = None

    def _put(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.close()

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], connect_s: float | None) -> _Conn:
        try:
            async with asyncio.timeout(connect_s):
                reader, writer = await asyncio.open_connection(*key, limit=_HEAD_LIMIT)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {key[0]}:{key[1]} in time") from None
        except OSError as e:
            raise httpx.ConnectError(_said(e)) from e
        return _Conn(reader, writer)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeout = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        body = await request.aread()
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += (name, b": ", value, b"\r\n")
        if body and "content-length" not in request.headers:
            head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
        data = b"".join(head) + b"\r\n" + body
        conn = self._take(key)
        if conn is not None:  # a kept connection may have been closed by the backend since
            try:
                return await self._exchange(request, key, conn, data, timeout)
            except _UnansweredError:
                pass
        conn = await self._connect(key, timeout.get("connect"))
        return await self._exchange(request, key, conn, data, timeout)

    async def _exchange(
        self,
        request: httpx.Request,
        key: tuple[str, int],
        conn: _Conn,
        data: bytes,
        timeout: dict[str, float | None],
    ) -> httpx.Response:
        """Send ``data`` on ``conn`` and read the answer's head; the body streams later."""
        try:
            conn.writer.write(data)
            if conn.writer.transport.get_write_buffer_size() > _READ:
                async with asyncio.timeout(timeout.get("write")):
                    await conn.writer.drain()
            async with asyncio.timeout(timeout.get("read")):
                raw = await conn.reader.readuntil(b"\r\n\r\n")
        except BaseException as e:  # cancelled too: the backend must see the request end
            conn.close()
            err = _head_error(e)
            if err is e:
                raise
            raise err from e
        return self._response(request, key, conn, raw, timeout.get("read"))

    def _response(
        self,
        request: httpx.Request,
        key: tuple[str, int],
        conn: _Conn,
        raw: bytes,
        read_s: float | None,
    ) -> httpx.Response:
        lines = raw[:-4].split(b"\r\n")
        try:
            version, code, *_ = lines[0].split(b" ", 2)
            status = int(code)
        except ValueError:
            conn.close()
            raise httpx.RemoteProtocolError(f"a malformed status line {lines[0][:80]!r}") from None
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        keep = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            value = value.strip()
            headers.append((name, value))
            low = name.lower()
            if low == b"content-length":
                with suppress(ValueError):
                    length = int(value)
            elif low == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif low == b"connection":
                keep = b"close" not in value.lower()
        if request.method == "HEAD" or status in _NO_BODY or 100 <= status < 200:
            length, chunked = 0, False
        stream = _Body(self, key, conn, None if chunked else length, chunked, keep, read_s)
        return httpx.Response(
            status,
            headers=headers,
            stream=stream,
            request=request,
            extensions={"http_version": version},
        )

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


class Upstream:
    """The gateway's forwarded requests: the client's body POSTed as it came, straight to
    the transport (the client's cookie jar, redirects and auth hooks are not for a
    relay, and cost ~10 % of the gateway thread per request behind the no-op backend).

    The probes, scrapes and ``/v1/models`` go through the gateway's ``httpx`` client.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        self.transport = transport
        self._timeout = timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    async def post(self, url: str, body: bytes) -> httpx.Response:
        """The answer once its head is in; its body streams (``aread`` / ``aiter_raw``,
        then ``aclose``, which a caller must reach)."""
        target = self._urls.get(url)
        if target is None:
            target = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            "POST",
            target,
            content=body,
            headers={"content-type": "application/json"},
            extensions={"timeout": self._timeout},
        )
        return await self.transport.handle_async_request(request)
