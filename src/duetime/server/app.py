"""`duetime serve`: the OpenAI-compatible, deadline-aware HTTP front of the engine.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus), and vLLM's ``/tokenize`` /
``/detokenize``. Each request becomes a
:class:`~duetime.core.request.Job` on the engine thread; its deadline, priority
and time-utility function are what the policy schedules by. Handlers only
tokenize, judge admission and relay tokens, so the event loop never waits on
a forward pass. A client that disconnects cancels its sequence at once (its KV
memory is freed by the engine on its next round).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from duetime.core.grammar import GrammarSpec
from duetime.core.image import EngineImage
from duetime.core.request import Job, LengthPrediction, TimeUtility
from duetime.core.request import Request as EngineRequest
from duetime.engine.grammar import GrammarCompiler, GrammarError, TokenGrammar
from duetime.engine.logprobs import LogprobLog
from duetime.predict.oracle import JobPredictor
from duetime.predict.served_lengths import ServedLengths
from duetime.server.admission import Admission
from duetime.server.answers import Meta, sse_answer, whole_answer
from duetime.server.chat_template import render_chat
from duetime.server.codec import Codec, Detokenizer
from duetime.server.engine_loop import EngineLoop, Submission
from duetime.server.errors import ApiError, BodyLimit, install_error_handlers
from duetime.server.grammar_steps import GrammarSteps
from duetime.server.metrics import ResponseCounter, ServerMetrics
from duetime.server.paths import StripTrailingSlash
from duetime.server.predict_batcher import PredictBatcher
from duetime.server.relay import Relay
from duetime.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from duetime.server.streams import Outcome, Stream

__all__ = ["ServerConfig", "ServerState", "create_app"]

_ROUTES = frozenset(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
    ]
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
    #: The engine's batch limits and how they were chosen (shown in /health, /v1/models).
    limits: dict[str, Any] | None = None


@dataclass(slots=True)
class ServerState:
    """Everything the handlers share."""

    config: ServerConfig
    engine: EngineLoop
    codec: Codec
    admission: Admission
    predictor: JobPredictor | None = None
    #: The served model's finished answers, which correct the predictor's points (None: off).
    served_lengths: ServedLengths | None = None
    metrics: ServerMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    #: The predictor runs here (its tokenizer is not safe to share between threads), off
    #: the event loop, on the requests waiting for it together (``predict_batcher``).
    predict_pool: ThreadPoolExecutor = field(
        init=False, default_factory=lambda: ThreadPoolExecutor(1, "duetime-predict")
    )
    predict_batcher: PredictBatcher = field(init=False)
    #: Structured outputs' grammars over the codec's vocabulary (compiled ones are kept).
    grammars: GrammarCompiler = field(init=False)
    #: The work (steps, riding rows) each grammar's answers took (jump-forward): what
    #: admission assumes.
    grammar_steps: GrammarSteps = field(init=False, default_factory=GrammarSteps)
    #: Sequences of requests that have arrived (their time taken) and are on their way
    #: to admission (their lengths being predicted): a burst's companions, which a
    #: forecast of the first of them expects beside it.
    arriving: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # Outcomes are counted by each request's Stream, as its client saw them.
        served = self.served_lengths
        self.metrics = ServerMetrics(
            lambda: self.engine.stats, (lambda: None) if served is None else served.summary
        )
        self.predict_batcher = PredictBatcher(self._predict_many, self.predict_pool)
        self.grammars = GrammarCompiler(lambda: self.codec.guidance_tokenizer())

    def counter(
        self,
        rid: int | None,
        grammar: GrammarSpec | None = None,
        answered: GrammarSpec | None = None,
    ) -> Callable[[Outcome], None]:
        """What hears a request's outcome: the metrics; the served-length window, for
        ``rid`` (a request whose answer it follows); the work its ``grammar``'s answers
        take (a request whose forced runs may jump); the lengths of the answers under
        ``answered``, its grammar however its tokens come; admission's record of its
        forecasts' errors, where it keeps one (``--deadline-confidence``)."""
        served = self.served_lengths
        errors = self.admission.errors
        watching = grammar is not None or answered is not None
        if (rid is None or served is None) and errors is None and not watching:
            return self.metrics.observe

        def count(outcome: Outcome) -> None:
            self.metrics.observe(outcome)
            if rid is not None and served is not None:
                served.end(rid, outcome.output_tokens, outcome.finish_reason)
            done = outcome.finish_reason in ("stop", "length")
            if answered is not None and outcome.finish_reason == "stop":
                self.grammar_steps.answered(answered, outcome.output_tokens)
            if grammar is not None and done:
                self.grammar_steps.observe(
                    grammar, outcome.output_tokens, outcome.jumped_tokens, outcome.rode_tokens
                )
            forecast = outcome.forecast_e2e
            if errors is not None and done and forecast is not None and outcome.deadline:
                errors.observe(forecast, outcome.e2e, outcome.deadline - outcome.arrival)

        return count

    def _predict_many(self, jobs: Sequence[Job]) -> list[LengthPrediction | None]:
        """Predictions for ``jobs`` (on the predictor's thread): one batch where the
        predictor takes one. The caller caps each at what its request may answer."""
        predictor = self.predictor
        if predictor is None:
            return [None] * len(jobs)
        many = getattr(predictor, "predict_requests", None)
        if many is not None:
            return list(many([j.request for j in jobs]))
        return [predictor.predict_job(j) for j in jobs]


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
        body: dict[str, Any] = {"status": status, "model": state.config.model_name}
        if state.config.limits is not None:
            body["limits"] = state.config.limits
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

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
                    **({"duetime_limits": state.config.limits} if state.config.limits else {}),
                }
            ],
        }

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts: list[tuple[list[int], str | None]] = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append((await _encode(state.codec, p), p))
            else:
                prompts.append(([int(i) for i in p], None))
        return await _serve(state, request, body, prompts, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        text = render_chat(body.messages, body.shown_tools())
        ids = await _encode(state.codec, text)
        limit = body.token_limit()
        if limit is None:  # as vLLM: never more than the context has left
            room = state.config.max_context - len(ids)
            limit = max(1, min(state.config.default_chat_max_tokens, room))
        return await _serve(state, request, body, [(ids, text)], limit, chat=True)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(state.config, body.model)
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
        _check_model(state.config, body.model)
        if any(i >= state.config.vocab_size for i in body.tokens):
            raise ApiError(400, f"tokens must be < {state.config.vocab_size}", param="tokens")
        return {"prompt": state.codec.decode(body.tokens)}

    return app


def _check_model(cfg: ServerConfig, model: str | None) -> None:
    """A 404 where the request names another model (None: this one)."""
    if model is not None and model != cfg.model_name:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {cfg.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )


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
    prompts: list[tuple[list[int], str | None]],
    max_tokens: int,
    *,
    chat: bool,
) -> Response:
    """Validate, judge and submit every choice of every prompt (ids, and text where it
    came as text); the answer, whole or streamed. Nothing is submitted unless every
    choice is admitted."""
    cfg = state.config
    _check_model(cfg, body.model)
    for k, (ids, _) in enumerate(prompts):
        _check_prompt(cfg, ids, max_tokens, f"prompt {k}: " if len(prompts) > 1 else "")
    if body.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", param="min_tokens")
    if any(i >= cfg.vocab_size for i in body.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be < {cfg.vocab_size}", param="stop_token_ids")
    if any(i >= cfg.vocab_size for i, _ in body.token_biases()):
        raise ApiError(400, f"logit_bias token ids must be < {cfg.vocab_size}", param="logit_bias")
    spec = body.grammar()
    grammar = await _grammar(state, spec)
    # no answer is longer than its grammar allows: predictions and admission use that
    bound = None if spec is None else spec.max_answer_tokens()
    longest = max_tokens if bound is None else min(max_tokens, bound)
    # nor more work than the grammar's recent answers did (steps, and the forced rows
    # riding in them), where its forced runs jump (not with log-probabilities or
    # segments: their tokens come a step each)
    jumping = spec if body.logprob_top_n() is None and body.segment is None else None
    work = None if jumping is None else state.grammar_steps.most(jumping)

    engine = state.engine
    now = engine.now()
    budget = body.deadline_s()
    tuf = None
    if body.tuf is not None:
        tuf = TimeUtility(ert=body.tuf.ert_ms / 1000.0, beta=body.tuf.beta, alpha=body.tuf.alpha)
    jobs = []
    for ids, text in prompts:
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
        jobs.append(Job(req, output_len=max_tokens))
    # (together: the predictor's batcher takes a request's prompts as one batch)
    sequences = len(jobs) * body.n
    state.arriving += sequences
    try:
        predicted = await asyncio.gather(*(_predicted(state, job) for job in jobs))
        gone = await request.is_disconnected()
    finally:
        state.arriving -= sequences  # (nothing awaits from here to admission)
    if gone:
        # Gone while its prompt was tokenized and its length predicted: nothing reaches
        # the engine (a prefill nobody reads), where the answer's own watch would abort
        # it only later. It took request ids, so /metrics counts it once, as the abort.
        # (From here to the hand-over nothing awaits: what admission judged is what the
        # next request's admission finds queued.)
        state.metrics.requests.labels("abort").inc()
        return Response(status_code=499)
    scored = isinstance(body, CompletionRequest) and body.scores_prompt()
    choices: list[tuple[int, int, Job]] = []  # (prompt, choice, its sequence)
    cached: dict[int, int] = {}
    # The served model's own answers correct the predictor where it predicts an answer
    # the model writes freely (no grammar, no forced or minimum length).
    served = state.served_lengths
    if spec is not None or body.ignore_eos or body.min_tokens:
        served = None
    correction = None if served is None else served.correction(_progress(engine.image))
    # under a grammar, its recent answers say how long this one is better than the
    # predictor can from the prompt (grammar_steps.py)
    known = None if spec is None else state.grammar_steps.lengths(spec, longest)
    points: dict[int, float] = {}  # request id -> the predictor's point, for the window
    for k, (job, pred) in enumerate(zip(jobs, predicted, strict=True)):
        if known is not None:
            job.request.predicted = known
        elif pred is not None and served is not None:
            job.request.predicted = served.correct(pred, longest, correction)
        else:
            job.request.predicted = None if pred is None else pred.capped(longest)
        # a scored prefill takes no hit
        hit = 0 if scored else engine.cached_prefix_len(job.request.prompt_token_ids or ())
        for i in range(body.n):  # choice 0 is the job; the others, copies under their own ids
            one = job
            if i:
                one = Job(dataclasses.replace(job.request, rid=engine.next_rid()), max_tokens)
            choices.append((k, i, one))
            cached[one.request.rid] = hit
            if pred is not None and served is not None:
                points[one.request.rid] = pred.point
    verdict = state.admission.admit(
        [one for _, _, one in choices],
        stats=engine.stats,
        queued=engine.stats.waiting + engine.inbox_size,
        budget_s=budget,
        allows_eviction=body.allows_eviction(),
        cached=cached,
        image=engine.image,
        pending=engine.pending_jobs(),
        longest=longest,
        work=work,
        arriving=state.arriving,
    )
    if not verdict.accept:
        state.metrics.rejected.labels(verdict.why).inc()
        k, i, _ = choices[verdict.which]
        which = [f"prompt {k + 1} of {len(jobs)}"] if len(jobs) > 1 else []
        if body.n > 1:
            which.append(f"choice {i + 1} of {body.n}")
        raise ApiError(
            429,
            f"{', '.join(which)}: {verdict.reason}" if which else verdict.reason,
            type="rate_limit_error",
            code={"queue": "queue_full", "deadline": "deadline_unreachable"}[verdict.why],
            headers={"Retry-After": str(verdict.retry_after_s)},
        )
    echoes = [_echo(state, body, ids, text) for ids, text in prompts]
    relays, submissions = [], []
    for k, i, one in choices:
        scored_ids = prompts[k][0] if scored else None
        choice_grammar = None if grammar is None else grammar.copy()
        rid = one.request.rid
        if served is not None and rid in points:
            served.start(rid, points[rid])
        count = state.counter(rid if rid in points else None, jumping, spec)
        relay, submission = _choice(
            state, body, one, i, k, echoes[k], scored_ids, choice_grammar, count
        )
        relays.append(relay)
        submissions.append(submission)
    engine.submit(*submissions)  # in one round: the choices' shared prompt is computed once
    meta = Meta(
        model=cfg.model_name,
        chat=chat,
        prompt_tokens=sum(len(ids) for ids, _ in prompts),
        tools=body.forced_tools() if isinstance(body, ChatCompletionRequest) else None,
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            sse_answer(relays, meta, include_usage, request, cfg.request_timeout_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await whole_answer(relays, meta, request, cfg.request_timeout_s)


def _check_prompt(cfg: ServerConfig, ids: list[int], max_tokens: int, which: str) -> None:
    """A 400 for a prompt the model cannot take (``which`` names it among several)."""
    if any(i >= cfg.vocab_size for i in ids):
        raise ApiError(400, f"{which}prompt token ids must be < {cfg.vocab_size}", param="prompt")
    if len(ids) >= cfg.max_context:
        raise ApiError(
            400,
            f"{which}the prompt ({len(ids)} tokens) leaves no room in the context length "
            f"{cfg.max_context}",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(ids) + max_tokens > cfg.max_context:
        raise ApiError(
            400,
            f"{which}prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context length {cfg.max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _choice(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    job: Job,
    choice: int,
    prompt_index: int,
    echo: str | None,
    scored_ids: list[int] | None,
    grammar: TokenGrammar | None,
    count: Callable[[Outcome], None],
) -> tuple[Relay, Submission]:
    """One choice's sequence for the engine (its tokens masked to ``grammar``, if any),
    and the relay that turns its tokens into text, showing its prompt's ``echo`` and,
    with ``scored_ids``, the prompt's scores."""
    engine = state.engine
    stream = Stream(asyncio.get_running_loop(), count)
    segmenter = None
    if body.segment is not None:
        from duetime.engine.segment_stop import TextSegmenter, make_rule

        segmenter = TextSegmenter(make_rule(body.segment), state.codec.decode)
    top_n = body.logprob_top_n()
    logprobs = None if top_n is None else LogprobLog(top_n, prompt=scored_ids is not None)
    submission = engine.submission(
        job,
        stream,
        stop_on_eos=not body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=body.stop_token_ids or (),
        segmenter=segmenter,
        sampling=body.sampling(choice),
        logprobs=logprobs,
        grammar=grammar,
    )
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    detok = Detokenizer(state.codec)
    relay = Relay(
        engine,
        job.request.rid,
        stream,
        stops,
        detok,
        body.min_tokens,
        logprobs,
        prompt_index=prompt_index,
        echo=echo,
        scored_ids=scored_ids,
    )
    return relay, submission


def _echo(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    text: str | None,
) -> str | None:
    """The prompt a completion with ``echo`` repeats: its text, or its ids decoded (also
    where its tokens are scored, so that their strings make up the echo exactly)."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    return text if text is not None and not body.scores_prompt() else state.codec.decode(ids)


async def _grammar(state: ServerState, spec: GrammarSpec | None) -> TokenGrammar | None:
    """The request's grammar at its start, compiled on a worker thread (the first one
    builds the tokenizer's table: seconds); a 400 naming the field where it is invalid."""
    if spec is None:
        return None
    try:
        grammar = await asyncio.to_thread(state.grammars.grammar, spec)
    except GrammarError as err:
        raise ApiError(400, str(err), param=err.field) from None
    steps = state.grammar_steps
    if steps.needs_prior(spec):  # once per grammar: a few ms, so off the event loop too
        steps.set_prior(spec, await asyncio.to_thread(grammar.choice_steps))
    return grammar


def _progress(image: EngineImage | None) -> list[tuple[int, int]]:
    """(request id, answer tokens so far) of every request on the engine."""
    return [] if image is None else [(s.request.rid, s.generated) for s in image.seqs]


async def _predicted(state: ServerState, job: Job) -> LengthPrediction | None:
    req = job.request
    if req.ignore_eos:
        return LengthPrediction.exact(float(req.max_tokens))
    if state.predictor is None:
        return None
    return await state.predict_batcher.predict(job)
