"""What the engine hands each request's reader: token batches, then one :class:`Outcome`.

The engine thread produces them; the event loop reads them. A round's items for
every stream reach the loop in one ``call_soon_threadsafe`` (:meth:`Stream.put_many`):
one wake-up of the loop a step, however many answers are streaming.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["FinishReason", "Outcome", "Stream"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True, frozen=True)
class Outcome:
    """How a request ended, in seconds on the engine clock."""

    finish_reason: FinishReason
    arrival: float
    first_token: float | None
    end: float
    #: Tokens of the answer, at least those the client has: a request a policy restarted
    #: can end (a stop string, an abort) before its re-run has made them all again.
    output_tokens: int
    kv_evicted_ratio: float = 0.0
    predicted_tokens: float | None = None
    #: When admission's forecast had the answer done (engine clock); None without one.
    forecast_finish: float | None = None
    deadline: float | None = None
    preemptions: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    #: Prompt tokens whose KV came from the prefix cache; None if it never reached the engine.
    cached_tokens: int | None = None
    #: Answer tokens its grammar forced that took no step of their own (jump-forward).
    jumped_tokens: int = 0
    #: Of those, the ones computed as extra rows of a step (the rest ended the answer).
    rode_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.end - self.arrival

    @property
    def forecast_e2e(self) -> float | None:
        return None if self.forecast_finish is None else self.forecast_finish - self.arrival

    @property
    def deadline_met(self) -> bool | None:
        if self.deadline is None:
            return None
        return self.finish_reason in ("stop", "length") and self.end <= self.deadline


class Stream:
    """The event-loop side of one request: batches of token ids, then one :class:`Outcome`.

    ``count`` (the server's metrics) hears each request's outcome exactly once. The
    reader counts what it read (:meth:`counted`), as the client saw it: a stop string can
    end an answer in the very token at which the engine ended it for another reason. An
    outcome nobody will read (the reader called :meth:`close`: the client left, timed
    out) is counted by whichever thread holds it then.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, count: Callable[[Outcome], None] | None = None
    ) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[list[int] | Outcome] = asyncio.Queue()
        self._count = count
        self.closed = False

    def put(self, item: list[int] | Outcome) -> None:
        """Called from the engine thread: one item, handed over on its own."""
        if not self.closed:
            self.loop.call_soon_threadsafe(self.deliver, item)
        elif isinstance(item, Outcome):
            self.counted(item)

    def deliver(self, item: list[int] | Outcome) -> None:
        """On the event loop: ``item`` into the reader's queue (or counted, if it left)."""
        if not self.closed:
            self._queue.put_nowait(item)
        elif isinstance(item, Outcome):
            self.counted(item)

    @staticmethod
    def put_many(items: Sequence[tuple[Stream, list[int] | Outcome]]) -> None:
        """Called from the engine thread: a round's items for many streams, handed to each
        event loop in one call (one wake-up of the loop a round, not one a stream)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, list[int] | Outcome]]] = {}
        for stream, item in items:
            if stream.closed:
                if isinstance(item, Outcome):
                    stream.counted(item)
                continue
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver_all, batch)

    async def get(self, timeout: float | None = None) -> list[int] | Outcome:
        return await asyncio.wait_for(self._queue.get(), timeout)

    def close(self) -> None:
        """The reader is gone (called on the event loop): count the outcome it left unread."""
        self.closed = True
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, Outcome):
                self.counted(item)

    def counted(self, outcome: Outcome) -> None:
        """Count ``outcome`` (once per request: the reader, or :meth:`put` after close)."""
        if self._count is not None:
            self._count(outcome)


def _deliver_all(batch: list[tuple[Stream, list[int] | Outcome]]) -> None:
    """On the event loop: a round's items into their streams."""
    for stream, item in batch:
        stream.deliver(item)
