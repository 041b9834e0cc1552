"""The HTTP shapes of one answer: OpenAI's JSON body, or its server-sent events.

:func:`whole_answer` collects the :class:`~duetime.server.relay.Relay` of each
choice (``n`` of them, one sequence each) into one completion body (answering
499 where the client leaves first); :func:`sse_answer` streams them as chunks,
interleaved as their tokens come, each choice's finish chunk with duetime's
timing, an optional usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from duetime.server.errors import ApiError
from duetime.server.logprob_format import (
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_logprobs,
)
from duetime.server.relay import Relay
from duetime.server.tool_calls import ForcedTools

__all__ = ["Meta", "sse_answer", "whole_answer"]


@dataclass(slots=True)
class Meta:
    """What every body or chunk of one answer repeats (OpenAI's id, model, created)."""

    model: str
    chat: bool
    prompt_tokens: int  # every prompt's
    #: A forced tool call: each answer comes back as its calls, not as text.
    tools: ForcedTools | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


async def whole_answer(
    relays: Sequence[Relay], meta: Meta, request: Request, timeout: float
) -> Response:
    """The answer as one JSON body; 499 where the client left, 500 where the engine failed."""
    waiter = asyncio.ensure_future(asyncio.gather(*(_collect(r, timeout) for r in relays)))
    # Where the client left, the answer is dropped unread, and the cancelled task may still
    # end with an error (wait_for can turn the cancel into its timeout, hence a 504):
    # retrieve it, or asyncio logs "Task exception was never retrieved" with a traceback.
    waiter.add_done_callback(_retrieve)
    try:
        while not waiter.done():
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if not done and await request.is_disconnected():
                waiter.cancel()
                _abort(relays)
                return Response(status_code=499)
        texts = waiter.result()
    except BaseException:
        waiter.cancel()
        _abort(relays)  # one choice failed (a timeout): the others are not wanted either
        raise
    for relay in relays:
        outcome = relay.outcome
        assert outcome is not None
        if outcome.finish_reason == "error":
            raise ApiError(500, f"the engine failed: {outcome.error}", type="server_error")
    return JSONResponse(_final_body(relays, meta, texts))


def _abort(relays: Sequence[Relay]) -> None:
    """Free every choice's sequence (harmless for one already finished)."""
    for relay in relays:
        relay.abort()


def _logprobs(relay: Relay, meta: Meta) -> dict[str, Any] | None:
    """The choice's ``logprobs`` for the tokens the client got since the last call."""
    if relay.logprobs is None:
        return None
    tokens = relay.take_logprobs()
    if meta.chat:
        return chat_logprobs(tokens, relay.detok.codec)
    return completion_logprobs(tokens, relay.detok.codec, shift=len(relay.echo or ""))


def _scored_prompt(relay: Relay) -> dict[str, Any] | None:
    """The echoed prompt's ``logprobs`` (None where its tokens are not scored)."""
    if relay.scored_ids is None or relay.logprobs is None:
        return None
    entries = relay.logprobs.prompt_entries or []
    return prompt_logprobs(relay.scored_ids, entries, relay.detok.codec)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _collect(relay: Relay, timeout: float) -> str:
    return "".join([d async for d in relay.deltas(timeout)])


def _usage(relays: Sequence[Relay], meta: Meta) -> dict[str, Any]:
    """OpenAI's usage: each prompt once, every choice's completion tokens. Cached: per
    prompt, the most any of its choices' sequences found (each one looks the prompt up
    when it is admitted)."""
    most: dict[int, int] = {}
    for r in relays:
        if r.outcome:
            k = r.prompt_index
            most[k] = max(most.get(k, 0), r.outcome.cached_tokens or 0)
    cached = sum(most.values())
    completion = sum(r.completion_tokens for r in relays)
    return {
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": meta.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _final_body(relays: Sequence[Relay], meta: Meta, texts: Sequence[str]) -> dict[str, Any]:
    obj = "chat.completion" if meta.chat else "text_completion"
    choices = []
    for i, (relay, text) in enumerate(zip(relays, texts, strict=True)):
        calls = _calls(relay, meta, text)
        if calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            choice: dict[str, Any] = {"message": message}
        elif meta.chat:
            choice = {"message": {"role": "assistant", "content": text}}
        else:
            choice = {"text": (relay.echo or "") + text}
        logprobs = _logprobs(relay, meta)
        prompt = _scored_prompt(relay)
        if prompt is not None and logprobs is not None:
            logprobs = joined(prompt, logprobs)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = _finish_reason(relay, meta, calls)
        if len(relays) > 1:  # each choice is a sequence of its own, with its own times
            choice["duetime"] = relay.timing().model_dump()
        choices.append(_choice(i, choice))
    body = _envelope(meta, obj, choices)
    body["usage"] = _usage(relays, meta)
    body["duetime"] = relays[0].timing().model_dump()
    return body


def _calls(relay: Relay, meta: Meta, text: str) -> list[dict[str, Any]] | None:
    """The choice's tool calls, where a forced call's answer is whole; None otherwise."""
    if meta.tools is None or relay.finish_reason() != "stop":
        return None
    return meta.tools.calls(text)


def _finish_reason(relay: Relay, meta: Meta, calls: list[dict[str, Any]] | None) -> str:
    if calls is not None and meta.tools is not None:
        return meta.tools.finish_reason()
    return relay.finish_reason()


def _chunk(
    meta: Meta,
    delta: str | None,
    reason: str | None,
    *,
    index: int = 0,
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
        return _envelope(meta, "chat.completion.chunk", [_choice(index, {"delta": d, **end})])
    return _envelope(meta, "text_completion", [_choice(index, {"text": delta or "", **end})])


def _held_answer(
    relay: Relay, meta: Meta, index: int, pieces: Sequence[tuple[str, dict[str, Any] | None]]
) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """A forced tool call's answer, sent whole once it is: (its calls, one chunk with them,
    each with its ``index`` in the list), or where ``max_tokens`` cut it short (None, one
    chunk with its text). ``pieces``: its deltas with their log-probabilities, which all
    ride on that chunk."""
    text = "".join(p for p, _ in pieces)
    present = [lp for _, lp in pieces if lp is not None]
    logprobs = {"content": [e for lp in present for e in lp.get("content") or []]}
    calls = _calls(relay, meta, text)
    if calls is None:
        return None, _chunk(meta, text, None, index=index, logprobs=logprobs if present else None)
    delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
    fields = {"delta": delta, "finish_reason": None, "logprobs": logprobs if present else None}
    return calls, _envelope(meta, "chat.completion.chunk", [_choice(index, fields)])


def _choice(index: int, fields: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "logprobs": None, **fields}


def _envelope(meta: Meta, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's response frame around its choices."""
    prefix = "chatcmpl-" if meta.chat else "cmpl-"
    return {
        "id": prefix + meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }


def _sse_line(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse_answer(
    relays: Sequence[Relay], meta: Meta, include_usage: bool, request: Request, timeout: float
) -> AsyncIterator[bytes]:
    """The answer as server-sent events, each choice's chunks as its tokens come; a client
    gone mid-stream aborts every choice's sequence."""
    finished = False
    try:
        for i, relay in enumerate(relays):
            if meta.chat:
                yield _sse_line(_chunk(meta, "", None, index=i, first=True))
            elif relay.echo and relay.scored_ids is None:
                yield _sse_line(_chunk(meta, relay.echo, None, index=i))
        failed = False
        # a forced tool call is sent whole at the end: its text, and the log-probabilities
        # of its tokens, wait for it
        held: dict[int, list[tuple[str, dict[str, Any] | None]]] = {}
        async for i, delta, logprobs in _merged(relays, meta, timeout):
            relay = relays[i]
            if delta is not None:
                if meta.tools is not None:
                    held.setdefault(i, []).append((delta, logprobs))
                else:
                    yield _sse_line(_chunk(meta, delta, None, index=i, logprobs=logprobs))
                continue
            outcome = relay.outcome
            assert outcome is not None
            if outcome.finish_reason == "error":
                err = {"message": f"the engine failed: {outcome.error}", "type": "server_error"}
                yield _sse_line({"error": err})
                failed = True  # the other choices are aborted below: the answer is void
                break
            calls = None
            if meta.tools is not None:
                calls, whole = _held_answer(relay, meta, i, [*held.pop(i, []), ("", logprobs)])
                yield _sse_line(whole)
                logprobs = None  # they rode on that chunk
            last = _chunk(
                meta,
                None if meta.chat else "",
                _finish_reason(relay, meta, calls),
                index=i,
                logprobs=logprobs,
            )
            last["duetime"] = relay.timing().model_dump()
            yield _sse_line(last)
        if include_usage and not failed:
            usage = _chunk(meta, None, None)
            usage["choices"] = []
            usage["usage"] = _usage(relays, meta)
            yield _sse_line(usage)
        yield b"data: [DONE]\n\n"
        finished = not failed
    except ApiError as e:
        yield _sse_line(e.body())
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            _abort(relays)  # the client went away, a choice failed or timed out: free them all
        del request


#: (choice, its text delta or None at its end, the log-probabilities of that delta's tokens)
_Event = tuple[int, str | None, dict[str, Any] | None]


async def _events(index: int, relay: Relay, meta: Meta, timeout: float) -> AsyncIterator[_Event]:
    """One choice's deltas with the log-probabilities of their tokens (taken as each delta
    is, so that a chunk carries its own tokens), then its end."""
    echo = relay.scored_ids is not None  # the echo waits for its scores: the prefill's
    async for delta in relay.deltas(timeout):
        if echo:
            yield index, relay.echo, _scored_prompt(relay)
            echo = False
        yield index, delta, _logprobs(relay, meta)
    if echo:
        yield index, relay.echo, _scored_prompt(relay)
    yield index, None, _logprobs(relay, meta)


async def _merged(relays: Sequence[Relay], meta: Meta, timeout: float) -> AsyncIterator[_Event]:
    """Every choice's events in the order they come (a task per choice when there are
    several); the first error (a timeout) is raised to the reader."""
    if len(relays) == 1:
        async for event in _events(0, relays[0], meta, timeout):
            yield event
        return
    queue: asyncio.Queue[_Event | Exception] = asyncio.Queue()

    async def pump(i: int, relay: Relay) -> None:
        try:
            async for event in _events(i, relay, meta, timeout):
                await queue.put(event)
        except Exception as e:  # handed to the reader, which raises it
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(relays)]
    try:
        left = len(relays)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item[1] is None:
                left -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
