"""The load a server accepted lately, replayed as the load still to come.

A forecast of the engine (``sim/forecast.py``) that plays out only the requests
it holds has the batch drain: steps grow cheaper and no new prompt is prefilled
ahead of the decoders. Under a steady stream neither happens, so such a forecast
is optimistic: on Gemma 3 270M at 3 requests/s its predicted end-to-end times were
0.65 of the real ones (median). Admission therefore extends each forecast with
requests like the recent ones: at the rate requests were accepted over the last
``window_s`` seconds, their shapes (prompt, assumed answer, deadline, priority)
taken from the newest accepted ones in turn.

Requests often come in bursts: a fleet of robots sending its commands together,
an agent fanning a task out into parallel calls. The first request of a burst is
judged before the server has seen the others, so a forecast of it alone has the
batch to itself: six Gemma robot commands sent together were forecast at a third
of their time. Arrivals less than ``burst_gap_s`` apart (chained) therefore count
as one burst, refused requests among them, and a request is forecast with the
companions its burst can be expected to add to the engine: of the recent bursts
at least as large as this one is known to be (its members judged so far, its own
sequences, those on their way through the server), how many of the members
judged after that point were accepted, on average. Counting the accepted, not the
arrived, keeps this honest under a tight deadline: when only the first two of six
can be served in time, the first expects one companion, not five, and is not
refused for load that will itself be refused. Until two bursts that large have
been seen, it expects those on their way, all accepted. Later load comes as
bursts too: at the rate bursts began, each the accepted members of a recent one,
newest first in turn. Arrivals that were never close together make bursts of
one, and then this is the even stream above.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from duetime.core.request import Job, LengthPrediction, Request, TimeUtility

__all__ = ["DEFAULT_BURST_GAP_S", "RecentLoad"]

#: Arrivals closer than this make one burst. A burst's requests reach the server
#: within a few ms of each other (each is parsed, then stamped, on the event loop);
#: Poisson arrivals at 3 requests/s are this close 14 % of the time, and such chance
#: pairs expect no companion (the bursts that reached a size rarely had more).
DEFAULT_BURST_GAP_S = 0.05

#: Bursts at least as large as a request's must have been seen this often before their
#: later members are expected beside it: one is a coincidence (a client that sends its
#: next request as soon as the last was refused makes a "burst" of two).
_EVIDENCE = 2


@dataclass(slots=True, frozen=True)
class _Shape:
    """What a forecast needs of an accepted request to play one like it."""

    prompt_len: int
    answer: int
    budget: float | None
    priority: int
    tuf: TimeUtility | None
    klass: str
    ride_rows: int = 0

    @classmethod
    def of(cls, job: Job, answer: int, ride_rows: int) -> _Shape:
        req = job.request
        return cls(
            req.prompt_len,
            answer,
            req.time_budget,
            req.priority,
            req.tuf,
            req.klass,
            ride_rows,
        )

    def job(self, rid: int, at: float) -> Job:
        """A request like this one, arriving at ``at``."""
        req = Request(
            rid=rid,
            arrival=at,
            prompt_len=self.prompt_len,
            max_tokens=self.answer,
            deadline=None if self.budget is None else at + self.budget,
            priority=self.priority,
            tuf=self.tuf,
            klass=self.klass,
        )
        req.predicted = LengthPrediction.exact(float(self.answer))
        return Job(req, output_len=self.answer, ride_rows=self.ride_rows)


@dataclass(slots=True, frozen=True)
class _Judged:
    """A request judged at ``arrival`` (``order``: the how-manieth), accepted as
    ``shape`` or refused (None)."""

    arrival: float
    order: int
    shape: _Shape | None


class RecentLoad:
    """Requests judged in the last ``window_s`` seconds (at most ``most``), accepted
    or refused, and the bursts they came in (arrivals within ``burst_gap_s`` of the one
    before; 0: no bursts, every accepted request alone, refusals forgotten and no
    companions expected)."""

    def __init__(
        self,
        window_s: float = 60.0,
        *,
        most: int = 512,
        least: int = 4,
        burst_gap_s: float = DEFAULT_BURST_GAP_S,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not burst_gap_s >= 0:
            raise ValueError(f"burst_gap_s must be >= 0, got {burst_gap_s}")
        self.window_s = window_s
        self.least = least  # fewer accepted than this: no rate is guessed
        self.burst_gap_s = burst_gap_s
        self._judged: deque[_Judged] = deque(maxlen=most)
        self._count = 0

    def note(self, job: Job, answer: int, ride_rows: int = 0) -> None:
        """``job`` was accepted; ``answer`` is the length assumed for it (``ride_rows``:
        the forced rows assumed to ride in its steps, ``Job.ride_rows``)."""
        self._add(job, _Shape.of(job, answer, ride_rows))

    def refused(self, job: Job) -> None:
        """``job`` was refused: a member of its burst that adds nothing to the engine."""
        if self.burst_gap_s:
            self._add(job, None)

    def _add(self, job: Job, shape: _Shape | None) -> None:
        self._judged.append(_Judged(job.request.arrival, self._count, shape))
        self._count += 1

    def _recent(self, now: float) -> list[_Judged]:
        return [j for j in self._judged if j.arrival > now - self.window_s]

    def _bursts(self, recent: list[_Judged]) -> list[list[_Judged]]:
        """``recent`` in bursts by arrival, oldest first; each in the order judged."""
        if not self.burst_gap_s:
            return [[j] for j in sorted(recent, key=lambda j: j.arrival) if j.shape is not None]
        bursts: list[list[_Judged]] = []
        for j in sorted(recent, key=lambda j: j.arrival):
            if bursts and j.arrival - bursts[-1][-1].arrival <= self.burst_gap_s:
                bursts[-1].append(j)
            else:
                bursts.append([j])
        return [sorted(b, key=lambda j: j.order) for b in bursts]

    def future(
        self,
        now: float,
        until: float,
        first_rid: int = -1,
        most: int = 256,
        *,
        joining: int = 1,
        arriving: int = 0,
        like: Job | None = None,
    ) -> list[Job]:
        """The load a request arriving at ``now`` can expect beside it, before ``until``
        (the first ``most``: a forecast's cost grows with them), rids counting down from
        ``first_rid`` (negative: never a real request's).

        First its burst's companions, arriving at ``now``: of the recent bursts at least
        as large as this one is known to be (the members judged so far, ``joining``
        sequences of its own, ``arriving`` of other requests on their way), the mean
        count of those judged after its own that were accepted, shaped like them (the
        newest such burst's); with fewer than two such bursts seen, the ``arriving``,
        shaped like ``like`` (the request itself). Then bursts at the rate bursts began
        over the window, each the accepted members of a recent one, newest first."""
        recent = self._recent(now)
        bursts = self._bursts(recent)
        here: list[_Judged] = []  # this request's burst, as far as it was judged
        if self.burst_gap_s and bursts and now - bursts[-1][-1].arrival <= self.burst_gap_s:
            here = bursts.pop()
        jobs: list[Job] = []

        def add(shape: _Shape, at: float) -> None:
            jobs.append(shape.job(first_rid - len(jobs), at))

        if self.burst_gap_s:
            shapes, n = _companions(bursts, len(here) + joining, arriving, like)
            for k in range(min(n, most) if shapes else 0):
                add(shapes[k % len(shapes)], now)
        if sum(j.shape is not None for j in recent) < self.least or not bursts:
            return jobs
        start = here[0].arrival if here else now  # when this burst began
        span = start - bursts[0][0].arrival  # len(bursts) bursts began in it
        if span <= 0:
            return jobs
        gap = span / len(bursts)
        k = max(0, math.floor((now - start) / gap))  # (a long burst: the next after now)
        while (t := start + (k + 1) * gap) < until and len(jobs) < most:
            burst = [j.shape for j in bursts[-1 - k % len(bursts)] if j.shape is not None]
            for shape in burst[: most - len(jobs)]:
                add(shape, t)
            k += 1
        return jobs


def _companions(
    bursts: list[list[_Judged]], seen: int, arriving: int, like: Job | None
) -> tuple[list[_Shape], int]:
    """What the companions of a burst with ``seen`` members judged or being judged and
    ``arriving`` more on their way look like, and how many of them to expect."""
    large = [b for b in bursts if len(b) >= seen + arriving]
    if len(large) < _EVIDENCE:  # no pattern yet: those on their way, like the request
        if like is None or not arriving:
            return [], 0
        return [_Shape.of(like, like.output_len, like.ride_rows)], arriving
    later = [[j.shape for j in b[seen:] if j.shape is not None] for b in large]
    n = math.floor(sum(map(len, later)) / len(later) + 0.5)
    shapes = next((s for s in reversed(later) if s), [])
    return shapes, n
