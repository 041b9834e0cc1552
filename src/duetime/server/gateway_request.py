"""What the gateway reads of a request (its answer's length, deadlines, priority, model
and whether it streams, from the body and from llm-d's SLO headers), and how it watches
the client while the request waits for a backend or runs there.

Deadlines come in three forms, all in milliseconds after the gateway receives the
request: the body's ``deadline_ms`` (or ``time_budget_ms``), a plain ``x-deadline-ms``
header, and llm-d's ``x-slo-ttft-ms`` (a bound on the first token) with
``x-slo-tpot-ms`` (a pace per output token), whose schedule ends the whole answer at
``ttft + tpot * max_tokens``. The earliest whole-answer deadline counts; the TTFT
bound is judged on its own. A pace without a TTFT bound sets no deadline.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from duetime.server.body_fields import MAX_MS, MAX_TOKENS_LIMIT
from duetime.server.errors import (
    BODY_EMPTY,
    BODY_NOT_OBJECT,
    BODY_UNPARSABLE,
    ApiError,
    body_type_message,
)

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def parse_body(raw: bytes, content_type: str) -> dict[str, Any]:
    """The request's JSON object, or the 400 the server would give for it: the gateway
    answers a body no backend could read in the backends' words, not with a 500 (JSON
    nested past Python's recursion limit) or a 200 (a JSON form sent as a form)."""
    if (wrong_type := body_type_message(content_type)) is not None:
        raise ApiError(400, wrong_type)
    if not raw.strip():
        raise ApiError(400, BODY_EMPTY)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, BODY_UNPARSABLE) from None
    if not isinstance(body, dict):
        raise ApiError(400, BODY_NOT_OBJECT)
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _checked(body: dict[str, Any], key: str, ok: Any, what: str) -> Any:
    """``body[key]`` where it is absent, null or ``ok(value)``; else the 400 a backend
    would give. The gateway reads these fields itself: read leniently, a wrong type was
    relayed and refused by the backend, or answered 503 when none was up."""
    v = body.get(key)
    if v is not None and not ok(v):
        raise ApiError(400, f"{key} must be {what}, got {v!r}"[:200], param=key)
    return v


def _request_fields(
    body: dict[str, Any], chat: bool
) -> tuple[int, float | None, int, str | None, bool]:
    def counts(v: Any) -> bool:
        return _is_int(v) and v >= 1

    def ms_number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= MAX_MS

    mt = _checked(body, "max_completion_tokens", counts, "an integer >= 1") if chat else None
    if mt is None:
        mt = _checked(body, "max_tokens", counts, "an integer >= 1")
    if mt is None:
        mt = 256 if chat else _DEFAULT_MAX_TOKENS
    if mt > MAX_TOKENS_LIMIT:  # the backend refuses it too; here it would overflow the estimate
        raise ApiError(400, f"max_tokens must be <= {MAX_TOKENS_LIMIT}", param="max_tokens")
    for key in ("deadline_ms", "time_budget_ms"):
        _checked(body, key, ms_number, f"a number of milliseconds > 0 and <= {MAX_MS:.0f}")
    ms = body.get("deadline_ms")
    if ms is None:
        ms = body.get("time_budget_ms")
    prio = _checked(body, "priority", _is_int, "an integer")
    stream = _checked(body, "stream", lambda v: isinstance(v, bool), "true or false")
    model = _checked(body, "model", lambda v: isinstance(v, str), "a string")
    deadline = None if ms is None else float(ms) / 1000.0
    return mt, deadline, prio or 0, model, bool(stream)


#: The deadline headers the gateway reads (lower case, as HTTP/2 and Starlette give them).
DEADLINE_HEADER = "x-deadline-ms"
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    """A header's milliseconds: a finite number > 0 and <= MAX_MS, else a 400 naming it."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        ms = float(raw.strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= MAX_MS):
        raise ApiError(
            400,
            f"header {name} must be a number of milliseconds > 0 and <= {MAX_MS:.0f}, "
            f"got {raw[:40]!r}",
            param=name,
            code="invalid_header",
        )
    return ms


def header_deadlines(
    headers: Mapping[str, str], max_tokens: int
) -> tuple[float | None, float | None]:
    """(whole-answer deadline, TTFT bound) in seconds from the deadline headers (None: not
    given). Every header given is checked, whether or not it sets a deadline."""
    plain = _header_ms(headers, DEADLINE_HEADER)
    ttft = _header_ms(headers, SLO_TTFT_HEADER)
    tpot = _header_ms(headers, SLO_TPOT_HEADER)
    schedule = None if ttft is None or tpot is None else ttft + tpot * max_tokens
    given = [ms for ms in (plain, schedule) if ms is not None]
    deadline = min(given) / 1000.0 if given else None
    return deadline, None if ttft is None else ttft / 1000.0


def earliest(*deadlines: float | None) -> float | None:
    """The earliest of the deadlines given (None when none is)."""
    given = [d for d in deadlines if d is not None]
    return min(given) if given else None


class _ClientGoneError(Exception):
    """The client disconnected while its request waited or ran upstream."""


async def _unless_client_leaves(request: Request, work: Any, poll_s: float = 0.25) -> Any:
    """Await ``work``, cancelling it (which closes an upstream request) if the client leaves.

    Starlette tells a handler about a disconnect only when asked, so it is polled.
    Work that completes although it was cancelled returns (or raises) as usual:
    the caller goes on, sends to a client that is gone, and counts one outcome.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})
                if task.cancelled():
                    raise _ClientGoneError
                # It finished meanwhile: its result stands, since dropping it would drop
                # a backend slot (acquire) or count an answered request twice (_whole).
                return task.result()
    except BaseException:
        task.cancel()
        raise
