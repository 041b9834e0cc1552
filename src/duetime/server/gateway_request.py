"""What the gateway reads of a request body (its answer's length, deadline, priority,
model and whether it streams), and how it watches the client while the request waits
for a backend or runs there."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from duetime.server.body_fields import MAX_MS, MAX_TOKENS_LIMIT
from duetime.server.errors import ApiError

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _request_fields(body: Any, chat: bool) -> tuple[int, float | None, int, str | None, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        mt = 256 if chat else _DEFAULT_MAX_TOKENS
    if mt > MAX_TOKENS_LIMIT:  # the backend refuses it too; here it would overflow the estimate
        raise ApiError(400, f"max_tokens must be <= {MAX_TOKENS_LIMIT}", param="max_tokens")
    ms = body.get("deadline_ms", body.get("time_budget_ms"))
    if isinstance(ms, int | float) and not isinstance(ms, bool) and ms > MAX_MS:
        raise ApiError(400, f"deadline_ms must be <= {MAX_MS:.0f}", param="deadline_ms")
    deadline = float(ms) / 1000.0 if isinstance(ms, int | float) and ms > 0 else None
    prio = body.get("priority", 0)
    prio = prio if isinstance(prio, int) and not isinstance(prio, bool) else 0
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return mt, deadline, prio, model, bool(body.get("stream", False))


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
