"""`duetime serve`: the OpenAI-compatible, deadline-aware HTTP front of the engine.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus). Each request becomes a
:class:`~duetime.core.request.Job` on the engine thread; its deadline, priority
and time-utility function are what the policy schedules by. Handlers only
tokenize, judge admission and relay tokens, so the event loop never waits on
a forward pass. A client that disconnects cancels its sequence at once (its KV
memory is freed by the engine on its next round).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from duetime.core.request import Job, LengthPrediction, TimeUtility
from duetime.core.request import Request as EngineRequest
from duetime.engine.logprobs import LogprobLog
from duetime.predict.oracle import JobPredictor
from duetime.server.admission import Admission
from duetime.server.chat_template import render_chat
from duetime.server.codec import Codec, Detokenizer
from duetime.server.engine_loop import EngineLoop, Outcome, Stream
from duetime.server.errors import ApiError, BodyLimit, install_error_handlers
from duetime.server.logprob_format import LoggedToken, chat_logprobs, completion_logprobs
from duetime.server.metrics import ResponseCounter, ServerMetrics
from duetime.server.paths import StripTrailingSlash
from duetime.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    TimingInfo,
)

__all__ = ["ServerConfig", "ServerState", "create_app"]

_ROUTES = frozenset(
    ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 413, 429, 500)
}


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    max_context: int  # prompt + max_tokens may not exceed this
    vocab_size: int
    #: A chat request without max_tokens gets this many, or what the context has left.
    default_chat_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body not complete by then: 408
    request_timeout_s: float = 600.0
    #: /health answers 503 once the engine has held work this long without finishing a
    #: step (a hung engine: the gateway's probe then routes around it).
    stall_after_s: float = 30.0


@dataclass(slots=True)
class ServerState:
    """Everything the handlers share."""

    config: ServerConfig
    engine: EngineLoop
    codec: Codec
    admission: Admission
    predictor: JobPredictor | None = None
    metrics: ServerMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    #: The predictor runs here, one prompt at a time (its tokenizer is not safe to share
    #: between threads), off the event loop: a fine-tuned encoder takes 7-15 ms a prompt.
    predict_pool: ThreadPoolExecutor = field(
        init=False, default_factory=lambda: ThreadPoolExecutor(1, "duetime-predict")
    )

    def __post_init__(self) -> None:
        # Outcomes are counted by each request's Stream, as its client saw them.
        self.metrics = ServerMetrics(lambda: self.engine.stats)


def create_app(state: ServerState, *, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With ``manage_engine`` the app's lifespan starts and stops the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
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

    @app.get("/health")
    async def health() -> JSONResponse:
        stalled = state.engine.stalled_s()
        if not state.engine.alive:
            status = "engine stopped"
        elif stalled > state.config.stall_after_s:
            status = f"engine stalled: no step finished in {stalled:.0f} s"
        else:
            status = "ok"
        return JSONResponse(
            {"status": status, "model": state.config.model_name},
            status_code=200 if status == "ok" else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.config.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "duetime",
                    "max_model_len": state.config.max_context,
                }
            ],
        }

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, list):
            ids = [int(i) for i in body.prompt]
            text = None
        else:
            text = body.prompt
            ids = await _encode(state.codec, text)
        return await _serve(state, request, body, ids, text, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        text = render_chat(body.messages)
        ids = await _encode(state.codec, text)
        limit = body.token_limit()
        if limit is None:  # as vLLM: never more than the context has left
            room = state.config.max_context - len(ids)
            limit = max(1, min(state.config.default_chat_max_tokens, room))
        return await _serve(state, request, body, ids, text, limit, chat=True)

    return app


# --- one request ---------------------------------------------------------------------
#: Prompts longer than this are tokenized on a worker thread: a 1 MB one takes ~0.3 s,
#: which on the event loop would hold up every other client's tokens (and deadlines).
_OFFLOAD_CHARS = 8192


async def _encode(codec: Codec, text: str) -> list[int]:
    if len(text) <= _OFFLOAD_CHARS:
        return codec.encode(text)
    return await asyncio.to_thread(codec.encode, text)


async def _serve(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    text: str | None,
    max_tokens: int,
    *,
    chat: bool,
) -> Response:
    cfg = state.config
    if body.model != cfg.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {cfg.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    if any(i >= cfg.vocab_size for i in ids):
        raise ApiError(400, f"prompt token ids must be < {cfg.vocab_size}", param="prompt")
    if len(ids) >= cfg.max_context:
        raise ApiError(
            400,
            f"the prompt ({len(ids)} tokens) leaves no room in the context length "
            f"{cfg.max_context}",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(ids) + max_tokens > cfg.max_context:
        raise ApiError(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"length {cfg.max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if body.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", param="min_tokens")

    engine = state.engine
    now = engine.now()
    budget = body.deadline_s()
    tuf = None
    if body.tuf is not None:
        tuf = TimeUtility(ert=body.tuf.ert_ms / 1000.0, beta=body.tuf.beta, alpha=body.tuf.alpha)
    req = EngineRequest(
        rid=engine.next_rid(),
        arrival=now,
        prompt_len=len(ids),
        max_tokens=max_tokens,
        deadline=None if budget is None else now + budget,
        priority=body.priority,
        tuf=tuf,
        klass=body.klass,
        prompt_token_ids=tuple(ids),
        ignore_eos=body.ignore_eos,
        prompt_text=text,
        overrun=None if body.overrun is None else body.overrun.replace("_", "-"),
        kv_eviction=body.kv_eviction,
    )
    job = Job(req, output_len=max_tokens)
    req.predicted = await _predicted(state, job)
    tokens = req.predicted.point if req.predicted is not None else float(max_tokens)
    verdict = state.admission.judge(
        engine.stats,
        engine.stats.waiting + engine.inbox_size,
        prompt_len=len(ids),
        tokens=tokens,
        budget_s=budget,
        allows_eviction=body.allows_eviction(),
    )
    if not verdict.accept:
        state.metrics.rejected.labels(verdict.why).inc()
        raise ApiError(
            429,
            verdict.reason,
            type="rate_limit_error",
            code={"queue": "queue_full", "deadline": "deadline_unreachable"}[verdict.why],
            headers={"Retry-After": str(verdict.retry_after_s)},
        )
    if await request.is_disconnected():
        # Gone while its prompt was tokenized and judged: nothing reaches the engine (a
        # prefill nobody reads), where the answer's own watch would abort it only later.
        # It took a request id, so /metrics counts it once, as the client's abort.
        state.metrics.requests.labels("abort").inc()
        return Response(status_code=499)
    stream = Stream(asyncio.get_running_loop(), state.metrics.observe)
    segmenter = None
    if body.segment is not None:
        from duetime.engine.segment_stop import TextSegmenter, make_rule

        segmenter = TextSegmenter(make_rule(body.segment), state.codec.decode)
    top_n = body.logprob_top_n()
    logprobs = None if top_n is None else LogprobLog(top_n)
    engine.submit(
        job,
        stream,
        stop_on_eos=not body.ignore_eos,
        min_tokens=body.min_tokens,
        segmenter=segmenter,
        sampling=body.sampling(),
        logprobs=logprobs,
    )
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    relay = _Relay(
        state, req.rid, stream, stops, Detokenizer(state.codec), body.min_tokens, logprobs
    )
    meta = _Meta(
        rid=req.rid,
        model=cfg.model_name,
        chat=chat,
        prompt_tokens=len(ids),
        echo=_echo(state, body, ids, text),
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(relay, meta, include_usage, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(relay, meta, request, cfg.request_timeout_s)


def _echo(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    text: str | None,
) -> str | None:
    """The prompt a completion with ``echo`` repeats: its text, or its ids decoded."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    return text if text is not None else state.codec.decode(ids)


async def _predicted(state: ServerState, job: Job) -> LengthPrediction | None:
    if state.predictor is None or job.request.ignore_eos:
        return _predict(state, job)  # nothing to run
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.predict_pool, _predict, state, job)


def _predict(state: ServerState, job: Job) -> LengthPrediction | None:
    req = job.request
    if req.ignore_eos:
        return LengthPrediction.exact(float(req.max_tokens))
    if state.predictor is None:
        return None
    p = state.predictor.predict_job(job)
    cap = float(req.max_tokens)
    return LengthPrediction(
        point=min(p.point, cap), lo=min(p.lo, cap), hi=min(p.hi, cap), confidence=p.confidence
    )


def _safe_end(text: str, stops: list[str]) -> int:
    """Index before the longest suffix of ``text`` that begins some stop string."""
    end = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


@dataclass(slots=True)
class _Meta:
    rid: int
    model: str
    chat: bool
    prompt_tokens: int
    echo: str | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


class _Relay:
    """Turns the engine's token batches into text deltas, applying stop strings."""

    def __init__(
        self,
        state: ServerState,
        rid: int,
        stream: Stream,
        stops: list[str],
        detok: Detokenizer,
        min_tokens: int = 0,
        logprobs: LogprobLog | None = None,
    ) -> None:
        self.state = state
        self.rid = rid
        self.stream = stream
        self.stops = stops
        self.detok = detok
        self.min_tokens = min_tokens
        self.sent = ""  # text handed to the client
        self.completion_tokens = 0
        self.outcome: Outcome | None = None
        self.stopped = False  # a stop string ended the answer
        #: Where in the text a stop string may begin: past the first ``min_tokens`` tokens
        #: ("never stop before this", as vLLM), None until they are in.
        self.floor: int | None = 0 if min_tokens <= 0 else None
        #: Where the engine puts the answer tokens' log-probabilities (None: not asked).
        self.logprobs = logprobs
        self._ends: list[int] = []  # with logprobs: the text's length after each token
        self._given = 0  # tokens whose log-probabilities the client has

    async def deltas(self, timeout: float) -> AsyncIterator[str]:
        """Text deltas until the answer ends; sets ``outcome``."""
        deadline = time.monotonic() + timeout
        while self.outcome is None:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                # Times out while no token comes (queued, a long prefill): that too is a 504.
                item = await self.stream.get(left)
            except TimeoutError:
                self.abort()
                raise ApiError(
                    504, "the request timed out in the server", type="server_error"
                ) from None
            if isinstance(item, Outcome):
                self.detok.flush()
                if self._ends:  # text held back at the end is the last token's
                    self._ends[-1] = len(self.detok.text)
                out = self._emit(final=True)
                self.outcome = self._as_seen(item)
                self.stream.counted(self.outcome)
                if out:
                    yield out
                break
            if self.stopped:
                continue  # generated before the engine saw the stop: not part of the answer
            self.completion_tokens += len(item)
            if self.logprobs is None:
                self.detok.add(item)
            else:  # one at a time: where each token's text ends
                for tok in item:
                    self.detok.add([tok])
                    self._ends.append(len(self.detok.text))
            if self.floor is None and self.completion_tokens >= self.min_tokens:
                self.floor = len(self.detok.text)
            out = self._emit(final=False)
            if out:
                yield out
            if self.stopped:
                # Ends the sequence as a normal "stop" (its deadline judged, its KV freed);
                # keep listening: the outcome still comes.
                self.state.engine.finish(self.rid)

    def _emit(self, *, final: bool) -> str:
        """The text that may be sent now: up to a stop string, holding back a possible start."""
        if self.stopped:
            return ""
        text = self.detok.text
        start = len(self.sent)
        end = len(text)
        floor = self.floor
        if floor is None:  # within min_tokens: no stop string counts, nothing is held back
            floor = end
        for stop in self.stops:
            cut = text.find(stop, max(start, floor))
            if cut >= 0 and cut < end:
                end = cut
                self.stopped = True
        if not self.stopped and not final:
            end = max(min(end, _safe_end(text, self.stops)), floor)
        out = text[start:end] if end > start else ""
        self.sent += out
        return out

    def take_logprobs(self) -> list[LoggedToken]:
        """The tokens whose text the client now has whole and whose log-probabilities it
        has not got yet; once the answer ended, every token with text in it.

        The newest token waits for the next (or the end): text the detokenizer still
        holds back is its, and a streamed answer must split its text as a whole one."""
        if self.logprobs is None:
            return []
        sent, ends, ended = len(self.sent), self._ends, self.outcome is not None
        upto = min(len(ends) if ended else len(ends) - 1, len(self.logprobs.entries))
        out = []
        for i in range(self._given, upto):
            start = ends[i - 1] if i else 0
            whole = ends[i] <= sent or (ended and not self.stopped)
            if not whole and not (ended and start < sent):
                break
            text = self.sent[start : min(ends[i], sent)]
            out.append(LoggedToken(self.logprobs.entries[i], text, start))
            self._given = i + 1
        return out

    def _as_seen(self, outcome: Outcome) -> Outcome:
        """The outcome as the client sees it: a stop string it got ends the answer as
        "stop", whatever the engine had ended it with meanwhile ("length" at the same
        token, a policy's "abort" or an engine "error" before the finish arrived)."""
        if self.stopped and outcome.finish_reason != "stop":
            return dataclasses.replace(outcome, finish_reason="stop", error=None)
        return outcome

    def abort(self) -> None:
        self.stream.close()
        self.state.engine.abort(self.rid)

    def finish_reason(self) -> str:
        assert self.outcome is not None
        return self.outcome.finish_reason

    def timing(self) -> TimingInfo:
        o = self.outcome
        assert o is not None
        return TimingInfo(
            ttft_ms=None if o.ttft is None else round(o.ttft * 1000, 3),
            e2e_ms=round(o.e2e * 1000, 3),
            deadline_met=o.deadline_met,
            kv_eviction_ratio=o.kv_evicted_ratio,
            predicted_tokens=o.predicted_tokens,
            preemptions=o.preemptions,
            completion_tokens=self.completion_tokens,
        )


async def _whole(relay: _Relay, meta: _Meta, request: Request, timeout: float) -> Response:
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


def _logprobs(relay: _Relay, meta: _Meta) -> dict[str, Any] | None:
    """The choice's ``logprobs`` for the tokens the client got since the last call."""
    if relay.logprobs is None:
        return None
    tokens = relay.take_logprobs()
    fmt = chat_logprobs if meta.chat else completion_logprobs
    return fmt(tokens, relay.state.codec)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _collect(relay: _Relay, timeout: float) -> str:
    return "".join([d async for d in relay.deltas(timeout)])


def _usage(relay: _Relay, meta: _Meta) -> dict[str, int]:
    return {
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": relay.completion_tokens,
        "total_tokens": meta.prompt_tokens + relay.completion_tokens,
    }


def _final_body(relay: _Relay, meta: _Meta, text: str) -> dict[str, Any]:
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
    meta: _Meta,
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


def _envelope(meta: _Meta, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
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


async def _sse(
    relay: _Relay, meta: _Meta, include_usage: bool, request: Request
) -> AsyncIterator[bytes]:
    finished = False
    try:
        if meta.chat:
            yield _sse_line(_chunk(meta, "", None, first=True))
        elif meta.echo:
            yield _sse_line(_chunk(meta, meta.echo, None))
        async for delta in relay.deltas(relay.state.config.request_timeout_s):
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
