"""One generation request from its parsed body to its answer: checks, grammar, length
predictions, admission of every choice at once, submission, and the answer whole or
streamed. Nothing is submitted unless every choice is admitted."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from duetime.core.grammar import GrammarSpec
from duetime.core.image import EngineImage
from duetime.core.request import Job, LengthPrediction, TimeUtility
from duetime.core.request import Request as EngineRequest
from duetime.engine.grammar import GrammarError, TokenGrammar
from duetime.predict.served_lengths import ServedLengths
from duetime.server.admission_ask import Verdict
from duetime.server.answers import Meta, sse_answer, whole_answer
from duetime.server.choice_relay import choice, echo
from duetime.server.errors import ApiError
from duetime.server.relay import Relay
from duetime.server.request_checks import check_model, check_prompt
from duetime.server.schemas import ChatCompletionRequest, CompletionRequest
from duetime.server.server_state import ServerConfig, ServerState

__all__ = ["serve"]

#: A prompt: its token ids, and its text where it came as text.
Prompt = tuple[list[int], str | None]


@dataclass(slots=True)
class _Choices:
    """Every sequence one HTTP request asks for, as admission judges them."""

    #: (prompt index, choice index, its sequence); choice 0 of a prompt is its job.
    rows: list[tuple[int, int, Job]] = field(default_factory=list)
    #: request id -> first prompt tokens the engine's prefix cache holds for it.
    cached: dict[int, int] = field(default_factory=dict)
    #: request id -> the predictor's point, where the served answers correct it.
    points: dict[int, float] = field(default_factory=dict)


async def serve(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    max_tokens: int,
    *,
    chat: bool,
) -> Response:
    """Validate, judge and submit every choice of every prompt; the answer, whole or
    streamed. Nothing is submitted unless every choice is admitted."""
    cfg = state.config
    _check(cfg, body, prompts, max_tokens)
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
    budget = body.deadline_s()
    jobs = _jobs(state, body, prompts, max_tokens, budget)
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
    # The served model's own answers correct the predictor where it predicts an answer
    # the model writes freely (no grammar, no forced or minimum length).
    served = state.served_lengths
    if spec is not None or body.ignore_eos or body.min_tokens:
        served = None
    picks = _choices(state, body, jobs, predicted, spec, longest, served, scored)
    verdict = state.admission.admit(
        [one for _, _, one in picks.rows],
        stats=engine.stats,
        queued=engine.stats.waiting + engine.inbox_size,
        budget_s=budget,
        allows_eviction=body.allows_eviction(),
        cached=picks.cached,
        image=engine.image,
        pending=engine.pending_jobs(),
        longest=longest,
        work=work,
        arriving=state.arriving,
    )
    if not verdict.accept:
        state.metrics.rejected.labels(verdict.why).inc()
        raise _refusal(verdict, picks, len(jobs), body.n)
    relays = _submit(state, body, prompts, picks, grammar, spec, served, jumping, scored)
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


def _check(
    cfg: ServerConfig,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    max_tokens: int,
) -> None:
    """The 400s a body earns before anything is compiled, predicted or judged."""
    check_model(cfg, body.model)
    for k, (ids, _) in enumerate(prompts):
        check_prompt(cfg, ids, max_tokens, f"prompt {k}: " if len(prompts) > 1 else "")
    if body.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", param="min_tokens")
    if any(i >= cfg.vocab_size for i in body.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be < {cfg.vocab_size}", param="stop_token_ids")
    if any(i >= cfg.vocab_size for i, _ in body.token_biases()):
        raise ApiError(400, f"logit_bias token ids must be < {cfg.vocab_size}", param="logit_bias")


def _jobs(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    max_tokens: int,
    budget: float | None,
) -> list[Job]:
    """One engine request a prompt, arriving now, with the body's time terms."""
    engine = state.engine
    now = engine.now()
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
    return jobs


def _choices(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    predicted: list[LengthPrediction | None],
    spec: GrammarSpec | None,
    longest: int,
    served: ServedLengths | None,
    scored: bool,
) -> _Choices:
    """Every choice of every prompt with its predicted length (the grammar's recent
    answers, else the predictor's corrected by the served answers, capped at
    ``longest``) and its prefix-cache hit; choices past the first are copies of their
    prompt's job under their own request ids."""
    engine = state.engine
    correction = None if served is None else served.correction(_progress(engine.image))
    # under a grammar, its recent answers say how long this one is better than the
    # predictor can from the prompt (grammar_steps.py)
    known = None if spec is None else state.grammar_steps.lengths(spec, longest)
    picks = _Choices()
    for k, (job, pred) in enumerate(zip(jobs, predicted, strict=True)):
        if known is not None:
            job.request.predicted = known
        elif pred is not None and served is not None:
            job.request.predicted = served.correct(pred, longest, correction)
        else:
            job.request.predicted = None if pred is None else pred.capped(longest)
        # a scored prefill takes no hit
        hit = 0 if scored else engine.cached_prefix_len(job.request.prompt_token_ids or ())
        for i in range(body.n):
            one = job
            if i:
                one = Job(dataclasses.replace(job.request, rid=engine.next_rid()), job.output_len)
            picks.rows.append((k, i, one))
            picks.cached[one.request.rid] = hit
            if pred is not None and served is not None:
                picks.points[one.request.rid] = pred.point
    return picks


def _refusal(verdict: Verdict, picks: _Choices, prompts: int, n: int) -> ApiError:
    """The 429 of a refused request, naming the prompt and choice admission refused
    where there are several, with its Retry-After."""
    k, i, _ = picks.rows[verdict.which]
    which = [f"prompt {k + 1} of {prompts}"] if prompts > 1 else []
    if n > 1:
        which.append(f"choice {i + 1} of {n}")
    return ApiError(
        429,
        f"{', '.join(which)}: {verdict.reason}" if which else verdict.reason,
        type="rate_limit_error",
        code={"queue": "queue_full", "deadline": "deadline_unreachable"}[verdict.why],
        headers={"Retry-After": str(verdict.retry_after_s)},
    )


def _submit(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    picks: _Choices,
    grammar: TokenGrammar | None,
    spec: GrammarSpec | None,
    served: ServedLengths | None,
    jumping: GrammarSpec | None,
    scored: bool,
) -> list[Relay]:
    """Hand every admitted choice to the engine in one round (the choices' shared
    prompt is computed once); the relays that turn their tokens into the answer."""
    echoes = [echo(state, body, ids, text) for ids, text in prompts]
    relays, submissions = [], []
    for k, i, one in picks.rows:
        scored_ids = prompts[k][0] if scored else None
        choice_grammar = None if grammar is None else grammar.copy()
        rid = one.request.rid
        if served is not None and rid in picks.points:
            served.start(rid, picks.points[rid])
        count = state.counter(rid if rid in picks.points else None, jumping, spec)
        relay, submission = choice(
            state, body, one, i, k, echoes[k], scored_ids, choice_grammar, count
        )
        relays.append(relay)
        submissions.append(submission)
    state.engine.submit(*submissions)
    return relays


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
