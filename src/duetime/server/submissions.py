"""A request on its way to the engine thread, and what the thread keeps of it once it is
on the engine."""

from __future__ import annotations

from dataclasses import dataclass

from duetime.core.request import Job
from duetime.engine.executor import StopRule
from duetime.engine.grammar import TokenGrammar
from duetime.engine.logprobs import LogprobLog
from duetime.engine.sampling import Sampler
from duetime.engine.segment_stop import TextSegmenter
from duetime.server.streams import Stream

__all__ = ["LiveRequest", "Submission"]


@dataclass(slots=True, frozen=True)
class Submission:
    """A request on its way to the engine thread, with what decides its tokens."""

    job: Job
    stream: Stream
    stop: StopRule | None
    segmenter: TextSegmenter | None
    sampler: Sampler | None
    logprobs: LogprobLog | None
    grammar: TokenGrammar | None


@dataclass(slots=True)
class LiveRequest:
    """A request on the engine, with what its client has been sent."""

    job: Job
    stream: Stream
    emitted: int = 0  # generated tokens already sent (a restarted sequence re-makes them)
    #: When the client's first token went out. The record's ``first_token`` is not it after
    #: a restart: the executor voids it (the simulator's books), but the client keeps what
    #: it has, so its TTFT stands.
    first_sent: float | None = None
