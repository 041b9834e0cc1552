"""One choice of a request: its sequence for the engine, and the relay that turns the
sequence's tokens into the client's text (with a completion's echoed prompt)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from duetime.core.request import Job
from duetime.engine.grammar import TokenGrammar
from duetime.engine.logprobs import LogprobLog
from duetime.server.chat_template import chat_stops
from duetime.server.relay import Relay
from duetime.server.schemas import ChatCompletionRequest, CompletionRequest
from duetime.server.server_state import ServerState
from duetime.server.streams import Outcome, Stream
from duetime.server.submissions import Submission

__all__ = ["choice", "echo"]


def choice(
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
    if isinstance(body, ChatCompletionRequest):
        stops = chat_stops(stops, ignore_eos=body.ignore_eos, grammar=grammar is not None)
    relay = Relay(
        engine,
        job.request.rid,
        stream,
        stops,
        state.codec,
        body.min_tokens,
        logprobs,
        prompt_index=prompt_index,
        echo=echo,
        scored_ids=scored_ids,
        lstrip=isinstance(body, ChatCompletionRequest),
    )
    return relay, submission


def echo(
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
