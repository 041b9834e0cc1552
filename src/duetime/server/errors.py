"""OpenAI-style errors: every failure a client causes is a 4xx with an ``error`` object.

Also the body guard, a plain ASGI middleware so that an oversize body is
refused while it streams in, before anything parses it, and a body that stops
coming is refused after a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ApiError", "BodyLimit", "error_json", "install_error_handlers"]

log = logging.getLogger("duetime.server")


@dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"  # OpenAI's field name
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        """The JSON OpenAI's clients read: an ``error`` object with all four keys."""
        return error_json(self.message, self.type, self.param, self.code)


def error_json(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# pydantic names the branch of a union it tried in the error's location: "str",
# "list[constrained-int]", "literal['off','auto']", "constrained-float", ...
_BRANCH_TYPES = {"str", "int", "float", "bool"}


def _is_branch(part: object) -> bool:
    return isinstance(part, str) and (part in _BRANCH_TYPES or any(c in part for c in "[-'"))


def _is_type_error(error: Mapping[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith("_type") or kind == "literal_error"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for the client: the field, and what is wrong with it.

    A union field (``prompt``, ``kv_eviction``) fails once per branch; a bound
    that a value of the right type broke ("greater than or equal to 0") says
    more than the branches of the wrong type, so it is the one reported, and
    where every branch failed on type their expectations are joined.
    """
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        return f"the body is not valid JSON: {errors[0].get('msg', '')}".rstrip(": "), None

    def field(error: Mapping[str, Any]) -> tuple[str, ...]:
        """The location up to the first union branch (the field the client wrote)."""
        out: list[str] = []
        for part in error.get("loc", ()):
            if _is_branch(part):
                break
            if part != "body":
                out.append(str(part))
        return tuple(out)

    def path(error: Mapping[str, Any]) -> str:
        return ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not _is_branch(p))

    target = field(errors[0])
    group = [e for e in errors if field(e) == target]
    bounds = [e for e in group if not _is_type_error(e)]
    if bounds:
        where, message = path(bounds[0]), str(bounds[0].get("msg", "invalid"))
        message = message.removeprefix("Value error, ")  # a validator's own words follow
    else:
        where = ".".join(target)
        msgs = list(dict.fromkeys(str(e.get("msg", "invalid")) for e in group))
        message = ", or ".join([msgs[0], *(m.removeprefix("Input should be ") for m in msgs[1:])])
    others = len({field(e) for e in errors}) - 1
    more = f" (and {others} more field{'s' if others > 1 else ''})" if others else ""
    return f"{where or 'body'}: {message}{more}", where or None


#: What the server and the gateway say of a body that is no JSON they can read.
BODY_UNPARSABLE = "the body could not be parsed: it must be UTF-8 JSON, nested not too deeply"
BODY_EMPTY = "the body is empty: send the request as a JSON object"
BODY_NOT_OBJECT = "the body must be a JSON object"


def body_type_message(content_type: str) -> str | None:
    """The 400's words for a body sent as something other than JSON (curl's ``-d`` sends
    a form); None for a JSON content type."""
    if "json" in content_type.lower():
        return None
    return (
        "the body must be a JSON object sent with Content-Type: application/json, "
        f"got {content_type or 'no Content-Type'}"
    )


def _body_message(exc: RequestValidationError, content_type: str) -> str | None:
    """What is wrong with a body that is no JSON object at all (None for any other
    error): pydantic's "body: Field required" for an empty one, and "Input should be a
    valid dictionary" for one sent without ``Content-Type: application/json`` (curl's
    ``-d`` sends a form), say neither."""
    errors = exc.errors()
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    if errors[0].get("type") not in ("missing", "model_attributes_type", "model_type"):
        return None  # the body's own rule (a model validator): its own words
    if (wrong_type := body_type_message(content_type)) is not None:
        return wrong_type
    return BODY_EMPTY if errors[0].get("type") == "missing" else BODY_NOT_OBJECT


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            exc.body(),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _body_message(exc, request.headers.get("content-type", ""))
        param = None
        if message is None:
            message, param = _validation_message(exc)
        return JSONResponse(error_json(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if message == "There was an error parsing the body":  # FastAPI's words for the rest
            message = BODY_UNPARSABLE
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":  # Starlette's bare words
            message = f"no route {where}"
        elif exc.status_code == 405 and message == "Method Not Allowed":
            allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
            message = f"{where}: method not allowed" + (f"; use {allowed}" if allowed else "")
        return JSONResponse(
            error_json(message, kind), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(
            error_json(f"internal error: {type(exc).__name__}", "server_error"), status_code=500
        )


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (declared or streamed), and
    bodies not complete within ``timeout_s`` with 408: a client that sent half a
    request otherwise held its connection, and a handler slot, until shutdown."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_refuse: Callable[[int], None] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        #: Called with the status refused (413, 408), e.g. to count it with the outcomes.
        self.on_refuse = on_refuse
        self._too_big = f"request body over {max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > self.max_bytes:
                    await self._refuse(send, 413, self._too_big)
                    return
        # Read the whole (bounded) body first, then replay it: refusing mid-way through the
        # app would race with the app's own error handling.
        chunks: list[bytes] = []
        seen = 0
        more = True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                why = f"the request body did not arrive within {self.timeout_s:g} s"
                await self._refuse(send, 408, why)
                return
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.max_bytes:
                await self._refuse(send, 413, self._too_big)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        first: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([first], receive), send)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(status)
        body = json.dumps(error_json(message, "invalid_request_error")).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if status == 408:  # the rest of the body may still come: do not read it as a request
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that hands out ``messages`` first, then defers to the real one."""
    queue = list(messages)

    async def replayed() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
