"""The server and the clients of the server property test: a server state built for a
scenario's engine, the app wrapped to count the requests it is handling, a wait for it
all to fall idle, a capture of the errors the server logs, and the concurrent clients
that send a scenario's calls and record what each saw (checking a body's or a stream's
shape as they read it).

Kept apart from ``tests/test_server_properties.py`` so that the test file holds the
property alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from duetime.server.app import ServerState
from duetime.server.build import ServeOptions, build_state
from tests.served import HalfPredictor
from tests.server_calls import BODY_LIMIT, MODEL, Call, Engine, Seen, make_codec, model

HANG_S = 30.0  # a client still unanswered after this found a hung handler


# --- the server -------------------------------------------------------------------------
def scenario_state(eng: Engine) -> ServerState:
    options = ServeOptions(
        model="tiny",
        predictor=None,
        policy=eng.policy,
        policy_kwargs=eng.options,
        kv_capacity=eng.kv_capacity,
        max_num_seqs=eng.max_num_seqs,
        max_batch_tokens=eng.max_batch_tokens,
        max_waiting=eng.max_waiting,
        request_timeout_s=eng.request_timeout_s,
        prefix_cache_tokens=eng.prefix_cache_tokens,
    )
    with pytest.MonkeyPatch.context() as mp:
        if eng.policy == "hsf":  # it orders by predicted lengths and needs a predictor
            mp.setattr("duetime.server.build._predictor", lambda _options: HalfPredictor())
        state: ServerState = build_state(options, model(), make_codec(eng.codec), MODEL)
    state.config.max_body_bytes = BODY_LIMIT
    return state


class Handling:
    """The app, counting the HTTP requests it is handling. A client that hung up may have
    left its whole request in the server's socket, to be handled after the client is gone:
    the server is done only when no handler runs."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.active = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def idle(state: ServerState, app: Handling, timeout: float = 15.0) -> None:
    """Wait until no request is being handled and the engine holds no request, no KV and
    no per-request state, for 50 ms on end (or fail)."""
    deadline = time.monotonic() + timeout
    engine = state.engine
    since = None
    while time.monotonic() < deadline:
        s, ex = engine.stats, engine.executor
        quiet = not (s.kv_used or s.running or s.waiting or s.suspended or engine.inbox_size)
        held = ex.kv_used or ex.kv_device or ex.seqs or ex.records or ex.tokens or ex.slots
        cache = ex.kv.slots or ex.kv.total_tokens or ex._spooled
        kept = engine._live or ex.stop_tokens or ex.segmenters or ex._replay
        kept = kept or ex.samplers or ex.logprob_logs
        if quiet and not held and not cache and not kept and not ex.in_system and not app.active:
            since = since or time.monotonic()
            if time.monotonic() - since >= 0.05:
                return
        else:
            since = None
        time.sleep(0.02)
    ex = engine.executor
    status = {rid: seq.status.name for rid, seq in ex.seqs.items()}
    pytest.fail(
        f"engine not idle: {engine.stats}, seqs={status}, live={list(engine._live)}, "
        f"cache slots={ex.kv.slots}, {app.active} requests in handling"
    )


@contextlib.contextmanager
def errors_logged() -> Iterator[list[str]]:
    """Errors the server logs meanwhile (its own, uvicorn's, asyncio's), as text."""
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if record.exc_info is not None:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
            logged.append(f"{record.name}: {text}")

    keep = Keep(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("duetime.server", "uvicorn.error", "asyncio")]
    for log in loggers:
        log.addHandler(keep)
    try:
        yield logged
    finally:
        for log in loggers:
            log.removeHandler(keep)


# --- the clients ------------------------------------------------------------------------
async def _talk(client: httpx.AsyncClient, url: str, c: Call) -> Seen:
    timeout = httpx.Timeout(HANG_S, read=c.leave_s + 0.001 if c.leave == "timeout" else HANG_S)
    request = client.build_request(
        "POST", url + c.path, content=c.body, headers=dict(c.headers), timeout=timeout
    )
    r = await client.send(request, stream=True)
    try:
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            return _whole(c, r.status_code, await r.aread(), r.headers)
        return await _events(c, r)
    finally:
        await r.aclose()


def _whole(c: Call, status: int, content: bytes, headers: httpx.Headers) -> Seen:
    seen = Seen(status, headers=dict(headers))
    try:
        data = json.loads(content)
    except ValueError:
        seen.problems.append(f"status {status} with a body that is not JSON: {content[:200]!r}")
        return seen
    if status != 200:
        seen.error = data.get("error") if isinstance(data, dict) else None
        return seen
    if c.stream:
        seen.problems.append("a stream was asked for and a JSON body came")
    seen.final = data
    choice = data["choices"][0]
    seen.text = choice["message"]["content"] if c.chat else choice["text"]
    seen.pieces = _pieces(c, choice)
    seen.scores = _scores(c, choice)
    seen.usage = data.get("usage")
    if data["object"] != ("chat.completion" if c.chat else "text_completion"):
        seen.problems.append(f"object {data['object']!r}")
    if c.chat and choice["message"]["role"] != "assistant":
        seen.problems.append(f"role {choice['message']['role']!r}")
    return seen


def _scores(c: Call, choice: dict[str, Any]) -> list[float | None]:
    """A completion choice's ``token_logprobs`` (none for chat or where not asked)."""
    lp = choice.get("logprobs")
    return [] if not lp or c.chat else list(lp["token_logprobs"])


def _pieces(c: Call, choice: dict[str, Any]) -> list[str]:
    """The answer tokens' strings a choice's ``logprobs`` lists (none where not asked)."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    return [t["token"] for t in lp["content"]] if c.chat else list(lp["tokens"])


async def _events(c: Call, r: httpx.Response) -> Seen:
    """Read an SSE stream and check its shape: chunks, one finish chunk, usage, [DONE]."""
    seen = Seen(200, headers=dict(r.headers))
    events: list[str] = []
    buf = ""
    async for piece in r.aiter_text():
        buf += piece
        while "\n\n" in buf:
            line, buf = buf.split("\n\n", 1)
            events.append(line)
            if c.leave == "drop" and len(events) > c.events:
                seen.status, seen.gone = None, "dropped"
                return seen
    if buf:
        seen.problems.append(f"the stream ends inside an event: {buf[-200:]!r}")
    if not events or events[-1] != "data: [DONE]" or events.count("data: [DONE]") != 1:
        seen.problems.append(f"the stream does not end with one [DONE]: {events[-2:]}")
        return seen
    ids = set()
    finals = []
    for n, line in enumerate(events[:-1]):
        if not line.startswith("data: {"):
            seen.problems.append(f"event {n} is not 'data: {{json}}': {line[:200]!r}")
            continue
        obj = json.loads(line.removeprefix("data: "))
        if "error" in obj:
            seen.error = obj["error"]
            if n != len(events) - 2:
                seen.problems.append("an error event that is not the last")
            continue
        ids.add(obj["id"])
        want = "chat.completion.chunk" if c.chat else "text_completion"
        if obj["object"] != want:
            seen.problems.append(f"chunk object {obj['object']!r}")
        if obj.get("usage"):
            if obj["choices"] or seen.usage is not None or not finals:
                seen.problems.append(f"a usage chunk with choices, twice or early: {obj}")
            seen.usage = obj["usage"]
            continue
        if finals:
            seen.problems.append(f"a chunk after the finish chunk: {obj}")
        (choice,) = obj["choices"]
        if c.chat:
            delta = choice["delta"]
            if n == 0 and delta.get("role") != "assistant":
                seen.problems.append(f"first chat chunk without the role: {obj}")
            seen.text += delta.get("content") or ""
        else:
            seen.text += choice["text"]
        seen.pieces += _pieces(c, choice)
        seen.scores += _scores(c, choice)
        if choice["finish_reason"] is not None:
            finals.append(obj)
    if len(ids) > 1:
        seen.problems.append(f"chunks with {len(ids)} ids")
    include_usage = bool((c.fields.get("stream_options") or {}).get("include_usage"))
    if seen.error is not None:
        seen.status = 504 if "timed out" in str(seen.error.get("message")) else 500
        if finals:
            seen.problems.append("an error event after a finish chunk")
        seen.final = {}
    elif len(finals) != 1:
        seen.problems.append(f"{len(finals)} chunks with a finish_reason")
    else:
        seen.final = finals[0]
        if include_usage and seen.usage is None:
            seen.problems.append("include_usage but no usage chunk")
        if not include_usage and seen.usage is not None:
            seen.problems.append("a usage chunk nobody asked for")
    return seen


async def _one(client: httpx.AsyncClient, url: str, c: Call) -> Seen:
    await asyncio.sleep(c.delay_s)
    work = asyncio.ensure_future(_talk(client, url, c))
    if c.leave == "cancel":
        await asyncio.wait({work}, timeout=c.leave_s)
        if not work.done():
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                return Seen(gone="cancelled")
    try:
        return await asyncio.wait_for(work, HANG_S)
    except TimeoutError:
        return Seen(problems=[f"no answer within {HANG_S} s"])
    except httpx.TimeoutException:
        if c.leave == "timeout":
            return Seen(gone="client timeout")
        return Seen(problems=["an httpx timeout of a client that meant to stay"])
    except httpx.HTTPError as e:
        return Seen(problems=[f"the connection failed: {e!r}"])


async def run(url: str, calls: list[Call]) -> list[Seen]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(_one(client, url, c) for c in calls))
