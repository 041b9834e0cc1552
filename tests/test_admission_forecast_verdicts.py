"""Admission by forecast: the verdicts on an engine's image played forward.

The estimate a formula gives sees only the queue's prefill and the batch as it is;
a forecast also sees the batch slot a request must wait for, the requests accepted
but not yet on the engine, and the other choices of the same request. It runs the
policy fork the image holds, falls back to the estimate when it fails, and assumes
an answer as long as its prediction, then the top of its interval.
"""

from __future__ import annotations

import dataclasses

from duetime.core.policy import Policy
from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.edf import EDF
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission, assumed_answer
from duetime.server.step_timer import StepTimer
from tests.admission_images import COST, STEP_S, ask_job, busy_image, make_admission


def test_a_request_that_must_wait_for_the_batch_is_refused_by_the_forecast_only() -> None:
    """The estimate counts 5 steps of 50 ms and accepts; the forecast knows the one
    slot is taken for 4.5 s more and refuses, saying when it would finish."""
    image, stats = busy_image()
    args = {"stats": stats, "queued": 0, "budget_s": 3.0, "allows_eviction": False, "cached": {}}
    job = ask_job(2, 5, image.now)
    assert make_admission(False).admit([job], **args).accept  # type: ignore[arg-type]
    verdict = make_admission(True).admit([job], image=image, **args)  # type: ignore[arg-type]
    assert not verdict.accept
    assert verdict.why == "deadline"
    assert "forecast of the engine (1 other requests on it" in verdict.reason
    assert "5 tokens assumed" in verdict.reason
    assert "more like" not in verdict.reason
    finish = 0.05 * 90 + 0.05 * 5  # the slot frees after 90 steps, then its own 5
    assert verdict.predicted_finish_s is not None
    assert abs(verdict.predicted_finish_s - finish) < 0.06
    assert verdict.retry_after_s == 2  # ceil(4.75 - 3)
    # Past twice its budget the forecast stops looking: "not within"
    short = make_admission(True).admit([job], image=image, **{**args, "budget_s": 2.0})  # type: ignore[arg-type]
    assert not short.accept
    assert "not within twice its deadline of 2000 ms" in short.reason
    assert short.predicted_finish_s is None
    assert short.retry_after_s == 2
    # With a second slot it starts at once: accepted, its finish on the request.
    image2, stats2 = busy_image(max_num_seqs=2)
    fine = ask_job(3, 5, image2.now)
    ok = make_admission(True).admit([fine], image=image2, **{**args, "stats": stats2})  # type: ignore[arg-type]
    assert ok.accept
    assert ok.predicted_finish_s is not None
    assert fine.request.forecast_finish == image2.now + ok.predicted_finish_s
    assert abs(ok.predicted_finish_s - 5 * STEP_S) < 0.06  # (prefill + 4 decode steps)


def test_the_forecast_runs_the_fork_the_image_holds_not_a_fresh_policy() -> None:
    """The engine's image carries its policy's fork (with the state it remembers); the
    admission's factory makes a fresh one only for an image that holds none."""
    image, stats = busy_image(max_num_seqs=2)
    assert isinstance(image.policy, EDF)
    made: list[Policy] = []

    def fresh() -> Policy:
        made.append(make_policy("edf"))
        return made[-1]

    args = {"stats": stats, "queued": 0, "budget_s": 3.0, "allows_eviction": False, "cached": {}}
    adm = Admission(StepTimer(prior=COST), policy=fresh)
    assert adm.admit([ask_job(2, 5, image.now)], image=image, **args).accept  # type: ignore[arg-type]
    assert made == []
    bare = dataclasses.replace(image, policy=None)
    assert adm.admit([ask_job(3, 5, image.now)], image=bare, **args).accept  # type: ignore[arg-type]
    assert len(made) == 1


def test_the_forecast_counts_accepted_requests_not_yet_on_the_engine_and_every_choice() -> None:
    """Two slots, one taken for 4.5 s: a 30-token request fits in the other (1.5 s)
    alone, not behind one accepted a moment ago that the engine has not taken yet, nor
    as two choices of one request. A refusal names the choice that misses."""
    image, stats = busy_image(max_num_seqs=2)
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    adm = make_admission(True)
    adm.recent.least = 10**9  # no load expected beyond what is named here
    assert adm.admit([ask_job(2, 30, image.now)], image=image, **args).accept  # type: ignore[arg-type]
    before = ask_job(3, 30, image.now)
    late = adm.admit([ask_job(4, 30, image.now)], image=image, pending=[before], **args)  # type: ignore[arg-type]
    assert not late.accept
    pair = [ask_job(5, 30, image.now), ask_job(6, 30, image.now)]
    both = adm.admit(pair, image=image, **args)  # type: ignore[arg-type]
    assert not both.accept
    assert both.which == 1
    # A job being handed over is in the image and in the pending list: counted once.
    held = adm.admit(
        [ask_job(7, 30, image.now)],
        image=image,
        pending=[Job(image.seqs[0].request, output_len=100)],
        **args,  # type: ignore[arg-type]
    )
    assert held.accept
    # Allowing eviction accepts it, degraded; with no deadline nothing is forecast.
    evict = adm.admit(pair, image=image, **{**args, "allows_eviction": True})  # type: ignore[arg-type]
    assert evict.accept
    assert evict.degraded
    free = adm.admit(pair, image=image, **{**args, "budget_s": None})  # type: ignore[arg-type]
    assert free.accept
    assert free.predicted_finish_s is None


class _NoFork(EDF):
    def fork(self) -> EDF:
        raise RuntimeError("no policy today")


def test_a_forecast_that_fails_falls_back_to_the_estimate() -> None:
    image, stats = busy_image()
    image = dataclasses.replace(image, policy=_NoFork())
    adm = Admission(StepTimer(prior=COST), policy=lambda: make_policy("edf"))
    verdict = adm.admit(
        [ask_job(2, 5, image.now)],
        stats=stats,
        queued=0,
        budget_s=2.0,
        allows_eviction=False,
        cached={},
        image=image,
    )
    assert verdict.accept
    assert "forecast" not in verdict.reason


def test_assumed_answer_is_the_prediction_then_the_top_of_its_interval() -> None:
    req = Request(rid=1, arrival=0.0, prompt_len=8, max_tokens=300, ignore_eos=False)
    assert assumed_answer(req) == 300  # no prediction: as long as it may be
    assert assumed_answer(req, most=4) == 4  # (a grammar's longest answer)
    req.predicted = LengthPrediction(point=100.4, lo=20, hi=250)
    assert assumed_answer(req) == 101
    assert assumed_answer(req, generated=50) == 101
    assert assumed_answer(req, generated=120) == 250  # past the point: the interval's top
    assert assumed_answer(req, generated=260) == 261  # past both: one more
    assert assumed_answer(req, generated=299) == 300  # never past max_tokens
