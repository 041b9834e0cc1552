"""The HTTP shapes of one answer: OpenAI's JSON body, or its server-sent events.

:func:`whole_answer` collects a :class:`~duetime.server.relay.Relay` into one
completion body (answering 499 where the client leaves first);
:func:`sse_answer` streams it as chunks, a finish chunk with duetime's timing,
an optional usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from duetime.server.errors import ApiError
from duetime.server.logprob_format import chat_logprobs, completion_logprobs
from duetime.server.relay import Relay

__all__ = ["Meta", "sse_answer", "whole_answer"]


@dataclass(slots=True)
class Meta:
    """What every body or chunk of one answer repeats (OpenAI's id, model, created)."""

    model: str
    chat: bool
    prompt_tokens: int
    echo: str | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


async def whole_answer(relay: Relay, meta: Meta, request: Request, timeout: float) -> Response:
    """The answer as one JSON body; 499 where the client left, 500 where the engine failed."""
    waiter = asyncio.ensure_future(_collect(relay, timeout))
    # Where the client left, the answer is dropped unread, and the cancelled task may still
    # end with an error (wait_for can turn the cancel into its timeout, hence a 504):
    # retrieve it, or asyncio logs "Task exception was never retrieved" with a traceback.
    waiter.add_done_callback(_retrieve)
    try:
        while not waiter.done():
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if not done and await request.is_disconnected():
                waiter.cancel()
                relay.abort()
                return Response(status_code=499)
        text = waiter.result()
    except BaseException:
        waiter.cancel()
        relay.abort()
        raise
    outcome = relay.outcome
    assert outcome is not None
    if outcome.finish_reason == "error":
        raise ApiError(500, f"the engine failed: {outcome.error}", type="server_error")
    body = _final_body(relay, meta, text)
    return JSONResponse(body)


def _logprobs(relay: Relay, meta: Meta) -> dict[str, Any] | None:
    """The choice's ``logprobs`` for the tokens the client got since the last call."""
    if relay.logprobs is None:
        return None
    tokens = relay.take_logprobs()
    fmt = chat_logprobs if meta.chat else completion_logprobs
    return fmt(tokens, relay.detok.codec)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _collect(relay: Relay, timeout: float) -> str:
    return "".join([d async for d in relay.deltas(timeout)])


def _usage(relay: Relay, meta: Meta) -> dict[str, Any]:
    cached = relay.outcome.cached_tokens if relay.outcome is not None else None
    return {
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": relay.completion_tokens,
        "total_tokens": meta.prompt_tokens + relay.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached or 0},
    }


def _final_body(relay: Relay, meta: Meta, text: str) -> dict[str, Any]:
    reason = relay.finish_reason()
    if meta.chat:
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice, obj = {"text": (meta.echo or "") + text}, "text_completion"
    choice["logprobs"] = _logprobs(relay, meta)
    body = _envelope(meta, obj, {**choice, "finish_reason": reason})
    body["usage"] = _usage(relay, meta)
    body["duetime"] = relay.timing().model_dump()
    return body


def _chunk(
    meta: Meta,
    delta: str | None,
    reason: str | None,
    *,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict:
    end = {"finish_reason": reason, "logprobs": logprobs}
    if meta.chat:
        d: dict[str, Any] = {}
        if first:
            d["role"] = "assistant"
        if delta is not None:
            d["content"] = delta
        return _envelope(meta, "chat.completion.chunk", {"delta": d, **end})
    return _envelope(meta, "text_completion", {"text": delta or "", **end})


def _envelope(meta: Meta, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response frame around one choice."""
    prefix = "chatcmpl-" if meta.chat else "cmpl-"
    return {
        "id": prefix + meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "logprobs": None, **choice}],
    }


def _sse_line(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse_answer(
    relay: Relay, meta: Meta, include_usage: bool, request: Request, timeout: float
) -> AsyncIterator[bytes]:
    """The answer as server-sent events; a client gone mid-stream aborts its sequence."""
    finished = False
    try:
        if meta.chat:
            yield _sse_line(_chunk(meta, "", None, first=True))
        elif meta.echo:
            yield _sse_line(_chunk(meta, meta.echo, None))
        async for delta in relay.deltas(timeout):
            yield _sse_line(_chunk(meta, delta, None, logprobs=_logprobs(relay, meta)))
        outcome = relay.outcome
        assert outcome is not None
        if outcome.finish_reason == "error":
            err = {"message": f"the engine failed: {outcome.error}", "type": "server_error"}
            yield _sse_line({"error": err})
        else:
            last = _chunk(
                meta,
                None if meta.chat else "",
                relay.finish_reason(),
                logprobs=_logprobs(relay, meta),
            )
            last["duetime"] = relay.timing().model_dump()
            yield _sse_line(last)
            if include_usage:
                usage = _chunk(meta, None, None)
                usage["choices"] = []
                usage["usage"] = _usage(relay, meta)
                yield _sse_line(usage)
        yield b"data: [DONE]\n\n"
        finished = True
    except ApiError as e:
        yield _sse_line({"error": {"message": e.message, "type": e.type}})
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            relay.abort()  # the client went away (or timed out): free the sequence now
        del request
