"""One path per route, with or without a trailing slash.

Starlette answers ``POST /v1/completions/`` with a bare 307 to the path
without the slash: a client that does not follow redirects on POST gets an
empty body and no error it can read. Both servers strip the slash instead
and serve the route itself.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["StripTrailingSlash"]


class StripTrailingSlash:
    """ASGI middleware: ``/a/b/`` is routed as ``/a/b`` (``/`` stays ``/``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            stripped = path.rstrip("/") or "/"
            scope = {**scope, "path": stripped, "raw_path": stripped.encode()}
        await self.app(scope, receive, send)
