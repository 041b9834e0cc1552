"""Admission control: refuse early what cannot be served in time.

A request is refused with 429 (and ``Retry-After``) when the queue is full, or
when its answer is predicted to miss its deadline. Two predictions are offered:

* **forecast** (the default): the engine's state, as its loop last imaged it,
  is played forward in the simulator under the served policy, forked in the
  state the image records (a fresh instance for a policy that cannot fork), and
  the step-cost model fitted online (``sim/forecast.py``), with the
  request (every choice of it) and those accepted but not yet on the engine
  arriving now. Each answer is taken to be as long as the length predictor says
  (``max_tokens`` with ``ignore_eos``; a running answer past its prediction, the
  top of its interval; under a grammar, no more than the engine steps its answers
  take, with the forced rows riding in them charged, ``server/grammar_steps.py``).
  The forecast sees what a formula misses: a full batch
  to wait for, the batch growing as the queue drains, where the policy puts the
  request, prefix-cache hits among the queued prompts. Each accepted choice
  carries its forecast finish (``Request.forecast_finish``), reported to the
  client as ``predicted_e2e_ms``.
* **estimate**: the optimistic formula

      t̂_finish = now + T_prefill(queued prompt tokens) + T_prefill(prompt − cached)
                 + N̂ · t_step(running + 1 decoders, KV in use + prompt)

  which ignores whatever a policy may put ahead of the request and the batch it
  waits for, so it errs towards accepting. It stands in where no forecast can be
  made (no engine image yet), and is what ``--admission estimate`` asks for.

With a deadline confidence (``--deadline-confidence c``) a forecast must meet the
deadline stretched by the ``c`` quantile of its recent errors
(``server/forecast_errors.py``): a target share of the accepted on time.

``cached`` is the prompt tokens the prefix cache holds now (their prefill is a
copy). A request that allows KV eviction (``kv_eviction`` not ``off``) is
accepted anyway, flagged as degraded: the policy (TimeBill) may trade quality
for time. Until the step timer has a model, deadlines are not judged at all.

This module holds :class:`Admission` (the queue, the estimate, the choice between
the two); the forecast is :mod:`~duetime.server.admission_forecast`, the verdict and
the answers a forecast assumes :mod:`~duetime.server.admission_ask`.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace as dataclass_replace

from duetime.core.grammar import AnswerWork
from duetime.core.image import EngineImage
from duetime.core.policy import Policy
from duetime.core.request import Job
from duetime.server.admission_ask import Verdict, _Ask, assumed_answer
from duetime.server.admission_forecast import ByForecast
from duetime.server.forecast_errors import ForecastErrors
from duetime.server.loop_outcomes import EngineStats
from duetime.server.recent_load import DEFAULT_BURST_GAP_S, RecentLoad
from duetime.server.step_timer import StepTimer

__all__ = ["ADMISSION_MODES", "Admission", "Verdict", "assumed_answer"]

ADMISSION_MODES = ("forecast", "estimate")

log = logging.getLogger("duetime.server")


class Admission(ByForecast):
    def __init__(
        self,
        timer: StepTimer,
        *,
        max_waiting: int = 256,
        policy: Callable[[], Policy] | None = None,
        errors: ForecastErrors | None = None,
        burst_gap_s: float = DEFAULT_BURST_GAP_S,
    ) -> None:
        """``policy`` makes a fresh instance of the served policy (a forecast runs it
        only where the engine's image holds no fork of the served one): with it,
        deadlines are judged by a forecast; without it, by the optimistic estimate.
        ``errors`` (with a forecast only): the recent forecasts' errors, whose margin
        a forecast must meet the deadline with (a target hit rate;
        ``server/forecast_errors.py``). ``burst_gap_s``: arrivals this close make one
        burst, whose companions a forecast expects (0: none; ``server/recent_load.py``)."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if errors is not None and policy is None:
            raise ValueError("a deadline confidence needs admission by forecast")
        self.timer = timer
        self.max_waiting = max_waiting
        self.policy = policy
        self.errors = errors
        # what was accepted lately, and in what bursts: the load a forecast expects
        self.recent = RecentLoad(burst_gap_s=burst_gap_s)
        # rid → the work assumed for an accepted structured answer (steps, riding rows),
        # so later forecasts see it as such while it waits or runs (the newest kept)
        self._work: OrderedDict[int, AnswerWork] = OrderedDict()
        self.forecast_walls: deque[float] = deque(maxlen=4096)  # seconds each forecast took

    @property
    def mode(self) -> str:
        return "estimate" if self.policy is None else "forecast"

    def estimate(
        self,
        stats: EngineStats,
        prompt_len: int,
        tokens: float,
        cached_tokens: int = 0,
        ride_rows: int = 0,
    ) -> float | None:
        """Optimistic seconds from now to the last token, or None without a step model
        (``ride_rows``: forced tokens riding in the answer's steps, a row each)."""
        if not self.timer.ready:
            return None
        t = self.timer.prefill_time(stats.waiting_prefill_tokens + prompt_len - cached_tokens)
        step = self.timer.step_time(0, stats.running + 1, stats.kv_used + prompt_len)
        rows = self.timer.step_time(ride_rows, 0, 0) - self.timer.step_time(0, 0, 0)
        return t + max(tokens - 1, 0.0) * step + rows

    def judge(
        self,
        stats: EngineStats,
        queued: int,
        *,
        prompt_len: int,
        tokens: float,
        budget_s: float | None,
        allows_eviction: bool,
        cached_tokens: int = 0,
        ride_rows: int = 0,
    ) -> Verdict:
        """One request by the optimistic estimate. ``queued``: requests waiting in the
        engine plus those not yet handed to it; ``cached_tokens``: of the prompt, those
        the prefix cache holds; ``ride_rows``: forced tokens riding in its steps."""
        if queued >= self.max_waiting:
            return self._queue_full(stats, queued)
        eta = self.estimate(stats, prompt_len, tokens, cached_tokens, ride_rows)
        if budget_s is None or eta is None or eta <= budget_s:
            return Verdict(True, predicted_finish_s=eta)
        if allows_eviction:
            return Verdict(
                True, "accepted with KV eviction allowed", predicted_finish_s=eta, degraded=True
            )
        return Verdict(
            False,
            f"the deadline cannot be met: predicted finish in {eta * 1000:.0f} ms "
            f"> {budget_s * 1000:.0f} ms ({tokens:.0f} predicted tokens, "
            f"{stats.running} running, {stats.waiting} waiting)",
            why="deadline",
            retry_after_s=max(1, math.ceil(eta - budget_s)),
            predicted_finish_s=eta,
        )

    def admit(
        self,
        jobs: Sequence[Job],
        *,
        stats: EngineStats,
        queued: int,
        budget_s: float | None,
        allows_eviction: bool,
        cached: Mapping[int, int],
        image: EngineImage | None = None,
        pending: Sequence[Job] = (),
        longest: int | None = None,
        work: AnswerWork | None = None,
        arriving: int = 0,
    ) -> Verdict:
        """Judge the sequences of one HTTP request together (every choice of every
        prompt; they arrive now and share the deadline ``budget_s``): accepted only if
        all are. ``queued`` counts the requests ahead of them; ``cached[rid]`` the
        prompt tokens of each the prefix cache holds; ``image`` and ``pending`` (accepted,
        not yet on the engine) are what a forecast plays forward; ``longest`` bounds
        their answers where a prediction does not (a grammar's longest text); ``work``
        bounds the engine steps one takes and gives the forced rows riding in them (its
        grammar's recent answers, forced runs jumping: ``server/grammar_steps.py``),
        which is what judging it counts. ``arriving``: sequences of other requests that
        arrived with these and are on their way to be judged (a burst: a forecast
        expects them beside these)."""
        ask = _Ask(jobs, budget_s, allows_eviction, cached, longest, work)
        verdict = self._judge_ask(ask, stats, queued, image, pending, arriving)
        for job in jobs:  # (a refused request is a member of its burst too)
            if not verdict.accept:
                self.recent.refused(job)
                continue
            assumed = ask.assumed(job)
            self.recent.note(job, assumed.output_len, assumed.ride_rows)
            if ask.work is not None:
                self._remember(job.request.rid, assumed.output_len, assumed.ride_rows)
        return verdict

    def _judge_ask(
        self,
        ask: _Ask,
        stats: EngineStats,
        queued: int,
        image: EngineImage | None,
        pending: Sequence[Job],
        arriving: int,
    ) -> Verdict:
        """:meth:`admit`'s verdict: by the queue's room, then by a forecast where one can
        be had, else by the estimate."""
        for i in range(len(ask.jobs)):
            if queued + i >= self.max_waiting:
                return dataclass_replace(self._queue_full(stats, queued + i), which=i)
        budget_s = ask.budget_s
        if self.policy is not None and image is not None and budget_s is not None and ask.jobs:
            try:
                verdict = self._by_forecast(ask, budget_s, image, pending, arriving)
            except Exception:  # a forecast must never cost a request: estimate instead
                log.exception("admission forecast failed; judging by the estimate")
            else:
                if verdict is not None:
                    return verdict
        return self._by_estimate(ask, stats, queued)

    def _by_estimate(self, ask: _Ask, stats: EngineStats, queued: int) -> Verdict:
        """Each sequence by :meth:`judge`, behind the ones before it."""
        verdict = Verdict(True)
        for i, job in enumerate(ask.jobs):
            req = job.request
            cap = req.max_tokens if ask.longest is None else min(req.max_tokens, ask.longest)
            tokens = float(cap) if req.predicted is None else req.predicted.point
            one = self.judge(
                stats,
                queued + i,
                prompt_len=req.prompt_len,
                tokens=ask.at_most_steps(tokens),
                budget_s=ask.budget_s,
                allows_eviction=ask.allows_eviction,
                cached_tokens=ask.cached.get(req.rid, 0),
                ride_rows=ask.ride_rows(tokens),
            )
            if not one.accept:
                return dataclass_replace(one, which=i)
            if one.degraded:
                verdict = one
        return verdict

    def _queue_full(self, stats: EngineStats, queued: int) -> Verdict:
        drain = self.timer.prefill_time(stats.waiting_prefill_tokens)
        return Verdict(
            False,
            f"the queue is full ({queued} request{'' if queued == 1 else 's'} waiting, "
            f"limit {self.max_waiting})",
            why="queue",
            retry_after_s=max(1, math.ceil(drain)),
        )
