"""Admission by forecast: the engine's image played forward in the simulator under the
served policy, with the request's sequences, those accepted but not yet on the engine,
and the load expected beside them arriving (``sim/forecast.py``); structured answers
as the work they were accepted for.

:class:`ByForecast` is the layer of :class:`~duetime.server.admission.Admission` that
judges this way; the module docstring of :mod:`duetime.server.admission` says when.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from duetime.core.grammar import AnswerWork
from duetime.core.image import EngineImage
from duetime.core.policy import Policy
from duetime.core.request import Job, Request
from duetime.server.admission_ask import Verdict, _Ask, assumed_answer
from duetime.server.forecast_errors import ForecastErrors
from duetime.server.recent_load import RecentLoad
from duetime.server.step_timer import StepTimer
from duetime.sim.forecast import forecast

__all__ = ["ByForecast"]

#: Accepted structured answers whose assumed work is kept for later forecasts (the newest).
_WORK_KEPT = 4096


class ByForecast:
    """Judges an ask by a forecast of the engine, and keeps the work structured answers
    were accepted for (:class:`~duetime.server.admission.Admission` sets the state)."""

    timer: StepTimer
    policy: Callable[[], Policy] | None
    errors: ForecastErrors | None
    recent: RecentLoad
    _work: OrderedDict[int, AnswerWork]
    forecast_walls: deque[float]

    def _remember(self, rid: int, steps: int, rows: int) -> None:
        self._work[rid] = AnswerWork(steps, rows)
        while len(self._work) > _WORK_KEPT:
            self._work.popitem(last=False)

    def _assumed(self, req: Request, generated: int = 0) -> Job:
        """What a forecast takes an accepted request (``generated`` tokens made) to be: a
        structured one as the work it was accepted for, what is left of it; any other as
        :func:`assumed_answer` tokens, a step each."""
        work = self._work.get(req.rid)
        if work is None:
            return Job(req, output_len=assumed_answer(req, generated))
        if generated <= 0:
            return Job(req, output_len=work.steps, ride_rows=work.rows)
        # made so far: tokens (its steps' and the rows that rode), so what is left is
        # that share of its steps and of its rows
        left = max(0.0, 1.0 - generated / (work.steps + work.rows))
        steps = max(1, math.ceil(work.steps * left))
        rows = work.rows * left
        # (Job.ride_rows spreads over every decode step of the answer: these rows over
        # the steps left)
        spread = rows * (generated + steps - 1) / steps
        return Job(req, output_len=generated + steps, ride_rows=round(spread))

    def _by_forecast(
        self,
        ask: _Ask,
        budget_s: float,
        image: EngineImage,
        pending: Sequence[Job],
        arriving: int = 0,
    ) -> Verdict | None:
        """All sequences in one fork (``budget_s``: the ask's), with the load expected
        beside them (their burst's companions, ``arriving`` of them known; later
        requests like the recent ones); None where there is no step model to forecast
        with."""
        cost = self.timer.as_cost()
        assert self.policy is not None
        if cost is None:
            return None
        jobs = ask.jobs
        now = jobs[0].request.arrival
        deadline = now + budget_s
        horizon = deadline + budget_s  # far enough to say by how much it misses
        known = {live.request.rid for live in image.seqs}
        arrivals = [
            self._assumed(j.request)
            for j in pending
            if j.request.rid not in known  # (a job being handed over may be in both)
        ]
        arrivals += [ask.assumed(j) for j in jobs]
        ahead = len(image.seqs) + len(arrivals) - len(jobs)
        future = self.recent.future(
            now, horizon, joining=len(jobs), arriving=arriving, like=ask.assumed(jobs[0])
        )
        policy = image.fork_policy()
        fc = forecast(
            image,
            self.policy() if policy is None else policy,
            cost,
            job_of=lambda live: self._assumed(live.request, live.generated),
            arrivals=[*arrivals, *future],
            cached=ask.cached,
            horizon=horizon,
            watch=[j.request.rid for j in jobs],
        )
        self.forecast_walls.append(fc.wall_s)
        ends = [fc.finish.get(j.request.rid) for j in jobs]
        for job, end in zip(jobs, ends, strict=True):
            job.request.forecast_finish = end  # as forecast: what the errors are learned from
        margin = 1.0 if self.errors is None else self.errors.margin()
        late = [
            i for i, end in enumerate(ends) if end is None or now + (end - now) * margin > deadline
        ]
        if not late:
            done = max(e for e in ends if e is not None)
            return Verdict(True, predicted_finish_s=done - now)
        if ask.allows_eviction:
            return Verdict(True, "accepted with KV eviction allowed", degraded=True)
        i = late[0]
        end = ends[i]
        if end is None:
            # the fork plays no further than twice the deadline (its horizon)
            when = f"not within twice its deadline of {budget_s * 1000:g} ms"
            retry = math.ceil(budget_s)
        else:
            when = f"in {(end - now) * 1000:.0f} ms"
            if margin != 1.0:
                assert self.errors is not None
                when += (
                    f", x{margin:.2f} for {self.errors.confidence:.0%} confidence (the recent "
                    f"forecasts' errors): {(end - now) * margin * 1000:.0f} ms"
                )
            when += f" > {budget_s * 1000:.0f} ms"
            retry = math.ceil(now + (end - now) * margin - deadline)
        with_it = sum(1 for j in future if j.request.arrival <= now)
        more = f", {with_it} arriving with it" if with_it else ""
        if len(future) > with_it:
            more += f", {len(future) - with_it} more like the recent ones arriving"
        return Verdict(
            False,
            f"the deadline cannot be met: a forecast of the engine ({ahead} other requests "
            f"on it or accepted{more}; {ask.assumed(jobs[i]).output_len} tokens assumed for "
            "this answer) "
            f"has it finish {when}",
            why="deadline",
            retry_after_s=max(1, retry),
            predicted_finish_s=None if end is None else end - now,
            which=i,
        )
