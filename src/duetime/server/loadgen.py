"""An open-loop load generator for any OpenAI-compatible endpoint (ours, vLLM, llama.cpp).

Each request is launched at its arrival time whether or not earlier ones have
answered (open loop: a slow server meets the same offered load as a fast one),
streams its answer, and is timed on the client with ``time.perf_counter``:
TTFT when the first non-empty text arrives, finish when the stream ends. The
run is bounded twice: at most ``max_requests`` are launched, none after
``duration_s``, and requests still in flight ``drain_timeout_s`` after the last
launch are cancelled (closing the connection, which aborts them on the server)
and counted as unfinished.

Outcomes: ``ok`` (the stream ended normally), ``rejected`` (HTTP 429, the
server's admission control said no; never retried), ``error`` (any other
status outside 2xx, redirects included, a broken or malformed stream, a
connection failure, a per-request timeout) and ``unfinished``. Whatever an
answer is, its request ends in exactly one of these. When the server is
duetime, the ``duetime`` object of its last chunk (``ttft_ms``, ``e2e_ms``,
``deadline_met``, ...) is kept beside the client's own measurements.

Wire format: docs/load.md.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from duetime.server.load_workload import DEFAULT_CLASS, LoadRequest, tuf_body, wire_ms

Status = Literal["ok", "rejected", "error", "unfinished"]
DONE = "[DONE]"
_DELAY_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")  # Retry-After in seconds


@dataclass(frozen=True, slots=True)
class Target:
    """What to call. ``base`` is the server root (no ``/v1``); ``chat`` selects
    ``/v1/chat/completions``; ``ignore_eos`` asks for exactly ``max_tokens`` tokens;
    ``system_prompt`` begins every request (a system message, or the prompt's start):
    the shared beginning a prefix cache serves."""

    base: str
    model: str
    chat: bool = False
    ignore_eos: bool = False
    api_key: str | None = None
    system_prompt: str | None = None
    #: Sent as llm-d's ``x-slo-ttft-ms`` with every request: a first-token bound, in ms.
    slo_ttft_ms: float | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request carries."""
        out = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.slo_ttft_ms is not None:
            out["x-slo-ttft-ms"] = f"{self.slo_ttft_ms:g}"
        return out

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass(frozen=True, slots=True)
class Bounds:
    """How much load one run may send and how long it may take (seconds)."""

    max_requests: int = 100
    duration_s: float = 60.0  # no launch after this
    drain_timeout_s: float = 30.0  # after the last launch, then what is in flight is cancelled
    request_timeout_s: float = 120.0  # longest silence (connect, send, between chunks)
    concurrency: int = 256  # connection pool size; more requests wait for a connection

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.concurrency < 1:
            raise ValueError("max_requests and concurrency must be >= 1")
        if min(self.duration_s, self.drain_timeout_s) < 0 or not self.request_timeout_s > 0:
            raise ValueError("duration and drain timeout must be >= 0, request timeout > 0")


@dataclass(slots=True)
class Outcome:
    """What happened to one request. Times are seconds since the run started."""

    request: LoadRequest
    status: Status = "unfinished"
    sent: float | None = None
    first_token: float | None = None
    finish: float | None = None  # stream ended normally
    ended: float | None = None  # a rejection or error came back
    chunks: int = 0  # chunks with non-empty text
    usage_tokens: int | None = None  # completion_tokens, when the server reports usage
    prompt_tokens: int | None = None  # the server's usage, when it reports it
    cached_tokens: int | None = None  # of those, served by its prefix cache (OpenAI's field)
    http_status: int | None = None
    retry_after_s: float | None = None
    error: str | None = None
    server: dict[str, Any] | None = None  # the duetime server's own report
    backend: str | None = None  # X-Duetime-Backend: where a duetime gateway sent it

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


@dataclass(slots=True)
class LoadRun:
    """One run: an outcome per planned request (those never sent keep ``sent=None``)."""

    outcomes: list[Outcome]
    launch_s: float  # from start to the last launch
    wall_s: float  # from start to the end of the drain

    @property
    def sent(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.sent is not None]


def request_body(req: LoadRequest, target: Target) -> dict[str, Any]:
    """The JSON body for ``req``; duetime's extensions (deadline, priority, class, overrun,
    KV eviction, TUF) only when the request has them (vLLM and llama.cpp ignore fields they
    do not know)."""
    body: dict[str, Any] = {"model": target.model}
    system = target.system_prompt
    if target.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if system:
            body["messages"].insert(0, {"role": "system", "content": system})
    else:
        body["prompt"] = (system or "") + req.prompt
    body.update(
        max_tokens=req.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    if target.ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.max_tokens)
    if req.deadline_s is not None:
        body["deadline_ms"] = wire_ms(req.deadline_s)
    if req.priority is not None:
        body["priority"] = req.priority
    if req.klass != DEFAULT_CLASS:
        body["klass"] = req.klass  # duetime keeps per-class statistics
    if req.overrun is not None:
        body["overrun"] = req.overrun.replace("-", "_")  # the API spells it skip_next
    if req.kv_eviction is not None:
        body["kv_eviction"] = req.kv_eviction
    if req.tuf is not None:
        body["tuf"] = tuf_body(req.tuf)
    return body


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A ``data:`` line's JSON object, :data:`DONE`, or None for anything else (comments,
    ``event:`` lines, blank keep-alives). Raises ValueError on a malformed payload."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == DONE:
        return DONE
    if not payload:
        return None
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise ValueError(f"stream chunk is not a JSON object: {payload[:80]!r}")
    return event


def chunk_text(event: dict[str, Any], chat: bool) -> str:
    """The text a chunk adds: ``choices[0].text`` or, for chat, ``choices[0].delta.content``.

    Raises ValueError when ``choices`` is there but not a list (a malformed chunk).
    """
    choices = event.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError(f"choices is not a list: {_brief(json.dumps(choices), 80)}")
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if chat:
        part = (choice.get("delta") or choice.get("message") or {}).get("content")
    else:
        part = choice.get("text")
    return part if isinstance(part, str) else ""


def run_load(
    requests: Sequence[LoadRequest],
    target: Target,
    bounds: Bounds,
    progress: Callable[[int, int], None] | None = None,
) -> LoadRun:
    """Send ``requests`` (open loop) and wait for them, within ``bounds``."""
    return asyncio.run(run_load_async(requests, target, bounds, progress))


async def run_load_async(
    requests: Sequence[LoadRequest],
    target: Target,
    bounds: Bounds,
    progress: Callable[[int, int], None] | None = None,
) -> LoadRun:
    """:func:`run_load` inside a running event loop."""
    planned = sorted(requests, key=lambda r: r.arrival)[: bounds.max_requests]
    outcomes = [Outcome(request=r) for r in planned]
    limits = httpx.Limits(
        max_connections=bounds.concurrency, max_keepalive_connections=bounds.concurrency
    )
    # Waiting for a pooled connection is part of the latency an open-loop client sees: no pool
    # timeout. trust_env=False: a proxy from the environment must not carry loopback load away.
    timeout = httpx.Timeout(bounds.request_timeout_s, pool=None)
    done = 0

    def finished(_: asyncio.Task[None]) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(outcomes))

    async with httpx.AsyncClient(
        base_url=target.base,
        headers=target.headers,
        limits=limits,
        timeout=timeout,
        trust_env=False,
    ) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        for outcome in outcomes:
            at = outcome.request.arrival
            if at > bounds.duration_s:
                break
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_send(client, target, outcome, t0))
            task.add_done_callback(finished)
            tasks.append(task)
        launch_s = time.perf_counter() - t0
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=bounds.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - t0
    return LoadRun(outcomes=outcomes, launch_s=launch_s, wall_s=wall_s)


async def _send(client: httpx.AsyncClient, target: Target, out: Outcome, t0: float) -> None:
    """Send one request and fill ``out``; never raises except on cancellation."""

    def now() -> float:
        return time.perf_counter() - t0

    body = request_body(out.request, target)
    out.sent = now()
    try:
        async with client.stream("POST", target.path, json=body) as resp:
            out.http_status = resp.status_code
            out.backend = resp.headers.get("x-duetime-backend")
            if not 200 <= resp.status_code < 300:  # a redirect is no answer either (not followed)
                text = (await resp.aread()).decode("utf-8", "replace")
                out.ended = now()
                if resp.status_code == 429:
                    out.status = "rejected"
                    out.retry_after_s = _seconds(resp.headers.get("retry-after"))
                else:
                    out.status = "error"
                    out.error = f"HTTP {resp.status_code}: {_brief(text)}"
                return
            if "text/event-stream" in resp.headers.get("content-type", ""):
                async for line in resp.aiter_lines():
                    event = parse_sse_line(line)
                    if event == DONE:
                        break
                    if isinstance(event, dict):
                        _absorb(out, event, target.chat, now())
            else:  # a server that ignored "stream": one JSON body
                _absorb(out, json.loads(await resp.aread()), target.chat, now())
            out.finish = now()
            out.status = "ok"
    except httpx.TimeoutException as e:
        _error(out, now(), f"timeout ({type(e).__name__})")
    except httpx.HTTPError as e:
        _error(out, now(), f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    except (ValueError, TypeError, AttributeError) as e:  # malformed JSON or chunk
        _error(out, now(), f"bad response: {e}")
    except Exception as e:  # whatever else a strange answer causes: escaping the task, it left
        # the request counted as unfinished (and asyncio logged "exception never retrieved")
        _error(out, now(), f"bad response: {type(e).__name__}: {e}")


def _absorb(out: Outcome, event: Any, chat: bool, at: float) -> None:
    if not isinstance(event, dict):
        raise ValueError(f"expected a JSON object, got {type(event).__name__}")
    if event.get("error"):
        raise ValueError(f"server error in stream: {_brief(json.dumps(event['error']))}")
    if chunk_text(event, chat):
        if out.first_token is None:
            out.first_token = at
        out.chunks += 1
    usage = event.get("usage")
    if isinstance(usage, dict):
        # A count only: true (an int to Python) or -1 would have been summed into the totals.
        if _count(tokens := usage.get("completion_tokens")):
            out.usage_tokens = tokens
        if _count(prompt := usage.get("prompt_tokens")):
            out.prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and _count(cached := details.get("cached_tokens")):
            out.cached_tokens = cached
    report = event.get("duetime")
    if isinstance(report, dict):
        out.server = report


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _error(out: Outcome, at: float, message: str) -> None:
    out.status, out.ended, out.error = "error", at, message


def _seconds(value: str | None) -> float | None:
    """Retry-After as seconds (an HTTP date is not worth parsing here).

    Only digits (with a fraction, which some servers send) count: ``float`` also took
    ``-1``, ``nan`` and ``inf``, which then made ``retry_after_mean_s`` negative or NaN.
    """
    if value is None or not _DELAY_SECONDS.fullmatch(value.strip()):
        return None
    return float(value)


def _brief(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
