"""`duetime serve`: the OpenAI-compatible, deadline-aware HTTP front of the engine.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not),
``/v1/models``, ``/v1/profile`` (the fitted step-cost model:
:mod:`~duetime.server.published_profile`), ``/health``, ``/metrics`` (Prometheus),
and vLLM's ``/tokenize`` / ``/detokenize``. Each request becomes a
:class:`~duetime.core.request.Job` on the engine thread; its deadline, priority
and time-utility function are what the policy schedules by. Handlers only
tokenize, judge admission and relay tokens, so the event loop never waits on
a forward pass. A client that disconnects cancels its sequence at once (its KV
memory is freed by the engine on its next round).

This module holds the app and its route handlers; one generation request's path
from body to answer is :mod:`~duetime.server.one_request`, the state the handlers
share :mod:`~duetime.server.server_state` (its classes re-exported here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from duetime.engine.openmp_workers import compute_on_one_thread
from duetime.server.chat_template import render_chat
from duetime.server.codec import Codec
from duetime.server.errors import ApiError, BodyLimit, install_error_handlers
from duetime.server.metrics import ResponseCounter
from duetime.server.one_request import serve
from duetime.server.paths import StripTrailingSlash
from duetime.server.published_profile import published_profile
from duetime.server.request_checks import check_model
from duetime.server.response_shapes import ErrorResponse
from duetime.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from duetime.server.server_state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "create_app"]

_ROUTES = frozenset(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/profile",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
    ]
)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 413, 429, 500)
}


def create_app(state: ServerState, *, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With ``manage_engine`` the app's lifespan starts and stops the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # the threads the loop hands blocking work to (tokenizing, grammars) compute on
        # one torch thread: the engine's alone has OpenMP workers (openmp_workers.py)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="duetime-io", initializer=compute_on_one_thread)
        )
        if manage_engine:
            state.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                state.engine.stop()

    app = FastAPI(
        title="duetime",
        version="0.1",
        summary="OpenAI-compatible, deadline-aware LLM serving (duetime extensions in the body).",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyLimit, max_bytes=state.config.max_body_bytes, timeout_s=state.config.body_timeout_s
    )
    app.add_middleware(ResponseCounter, metrics=state.metrics, routes=_ROUTES)
    app.add_middleware(StripTrailingSlash)  # outermost: the others see the routed path
    app.state.duetime = state
    # a connection closed for late headers (header_timeout) never reached a route: "other"
    app.state.on_header_timeout = lambda: state.metrics.responses.labels("other", "408").inc()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> JSONResponse:
        stalled = state.engine.stalled_s()
        if not state.engine.alive:
            status = "engine stopped"
        elif stalled > state.config.stall_after_s:
            status = f"engine stalled: no step finished in {stalled:.0f} s"
        else:
            status = "ok"
        body: dict[str, Any] = {"status": status, "model": state.config.model_name}
        if state.config.limits is not None:
            body["limits"] = state.config.limits
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/profile", responses={503: {"model": ErrorResponse}})
    async def profile() -> JSONResponse:
        body = published_profile(state)
        if body is None:
            raise ApiError(
                503,
                "no step-cost model yet: no --profile was given, none was measured at "
                "start, and too few steps have been served for the online fit",
                type="server_error",
                code="no_cost_model",
                headers={"Retry-After": "5"},
            )
        return JSONResponse(body)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.config.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "duetime",
            "max_model_len": state.config.max_context,
            **({"duetime_limits": state.config.limits} if state.config.limits else {}),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", responses={404: {"model": ErrorResponse}})
    async def model(model: str) -> dict[str, Any]:
        """One model, as OpenAI's ``models.retrieve`` asks for it."""
        check_model(state.config, model)
        return model_card()

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts: list[tuple[list[int], str | None]] = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append((await _encode(state.codec, p), p))
            else:
                prompts.append(([int(i) for i in p], None))
        return await serve(state, request, body, prompts, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        text = render_chat(body.messages, body.shown_tools())
        ids = await _encode(state.codec, text)
        limit = body.token_limit()
        if limit is None:  # as vLLM: never more than the context has left
            room = state.config.max_context - len(ids)
            limit = max(1, min(state.config.default_chat_max_tokens, room))
        return await serve(state, request, body, [(ids, text)], limit, chat=True)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(state.config, body.model)
        if body.messages is not None:
            ids = await _encode(state.codec, render_chat(body.messages, body.shown_tools()))
        else:
            ids = await _encode(state.codec, body.prompt or "")
            if not body.add_special_tokens and ids and ids[0] == state.codec.bos_id:
                ids = ids[1:]
        strs = [state.codec.decode([i]) for i in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.config.max_context,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(state.config, body.model)
        if any(i >= state.config.vocab_size for i in body.tokens):
            raise ApiError(400, f"tokens must be < {state.config.vocab_size}", param="tokens")
        return {"prompt": state.codec.decode(body.tokens)}

    return app


#: Prompts longer than this are tokenized on a worker thread: a 1 MB one takes ~0.3 s,
#: which on the event loop would hold up every other client's tokens (and deadlines).
_OFFLOAD_CHARS = 8192


async def _encode(codec: Codec, text: str) -> list[int]:
    if len(text) <= _OFFLOAD_CHARS:
        return codec.encode(text)
    return await asyncio.to_thread(codec.encode, text)
