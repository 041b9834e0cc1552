"""The load a server accepted lately, replayed as the load still to come.

A forecast of the engine (``sim/forecast.py``) that plays out only the requests
it holds has the batch drain: steps grow cheaper and no new prompt is prefilled
ahead of the decoders. Under a steady stream neither happens, so such a forecast
is optimistic: on Gemma 3 270M at 3 requests/s its predicted end-to-end times were
0.65 of the real ones (median). Admission therefore extends each forecast with
requests like the recent ones: at the rate requests were accepted over the last
``window_s`` seconds, evenly spaced, their shapes (prompt, assumed answer,
deadline, priority) taken from the newest accepted ones in turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from duetime.core.request import Job, LengthPrediction, Request, TimeUtility

__all__ = ["RecentLoad"]


@dataclass(slots=True, frozen=True)
class _Shape:
    arrival: float
    prompt_len: int
    answer: int
    budget: float | None
    priority: int
    tuf: TimeUtility | None
    klass: str
    ride_rows: int = 0


class RecentLoad:
    """Accepted requests of the last ``window_s`` seconds (at most ``most``)."""

    def __init__(self, window_s: float = 60.0, *, most: int = 512, least: int = 4) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.least = least  # fewer accepted than this: no rate is guessed
        self._shapes: deque[_Shape] = deque(maxlen=most)

    def note(self, job: Job, answer: int, ride_rows: int = 0) -> None:
        """``job`` was accepted; ``answer`` is the length assumed for it (``ride_rows``:
        the forced rows assumed to ride in its steps, ``Job.ride_rows``)."""
        req = job.request
        self._shapes.append(
            _Shape(
                req.arrival,
                req.prompt_len,
                answer,
                req.time_budget,
                req.priority,
                req.tuf,
                req.klass,
                ride_rows,
            )
        )

    def _recent(self, now: float) -> list[_Shape]:
        return [s for s in self._shapes if s.arrival > now - self.window_s]

    def rate(self, now: float) -> float | None:
        """Accepted requests a second over the window; None with too few to tell."""
        return self._rate(self._recent(now), now)

    def _rate(self, recent: list[_Shape], now: float) -> float | None:
        if len(recent) < self.least:
            return None
        span = min(self.window_s, now - min(s.arrival for s in recent))
        return len(recent) / span if span > 0 else None

    def future(self, now: float, until: float, first_rid: int = -1, most: int = 256) -> list[Job]:
        """Requests like the recent ones, arriving after ``now`` and before ``until``
        at :meth:`rate` (the first ``most``: a forecast's cost grows with them), with
        rids counting down from ``first_rid`` (negative: never a real request's)."""
        recent = self._recent(now)
        rate = self._rate(recent, now)
        if rate is None:
            return []
        shapes = recent[::-1]  # newest first
        jobs = []
        k = 0
        while (t := now + (k + 1) / rate) < until and k < most:
            s = shapes[k % len(shapes)]
            req = Request(
                rid=first_rid - k,
                arrival=t,
                prompt_len=s.prompt_len,
                max_tokens=s.answer,
                deadline=None if s.budget is None else t + s.budget,
                priority=s.priority,
                tuf=s.tuf,
                klass=s.klass,
            )
            req.predicted = LengthPrediction.exact(float(s.answer))
            jobs.append(Job(req, output_len=s.answer, ride_rows=s.ride_rows))
            k += 1
        return jobs
