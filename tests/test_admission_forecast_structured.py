"""Admission by forecast of structured answers: a grammar's bound and its work.

A grammar's longest answer stands in for a missing length prediction; an answer
accepted as a grammar's steps and riding rows is forecast as that work, and what is
left of it as its share of those steps and rows.
"""

from __future__ import annotations

import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.grammar import AnswerWork
from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission
from duetime.server.engine_loop import EngineStats
from duetime.server.step_timer import StepTimer
from duetime.sim.simulator import SimConfig, Simulator
from tests.admission_images import COST, ask_job, busy_image, make_admission


def test_a_grammar_bound_stands_in_for_a_missing_prediction() -> None:
    """No length predictor, ``max_tokens`` 64 but a grammar that ends within 4 tokens:
    judged as 4 tokens by both modes (64 steps of 50 ms would miss 2 s)."""
    image, stats = busy_image(max_num_seqs=2)
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    for forecast in (True, False):
        req = Request(rid=2, arrival=image.now, prompt_len=8, max_tokens=64, deadline=image.now + 2)
        job = Job(req, output_len=64)
        assert not make_admission(forecast).admit([job], image=image, **args).accept  # type: ignore[arg-type]
        bounded = make_admission(forecast).admit([job], image=image, longest=4, **args)  # type: ignore[arg-type]
        assert bounded.accept, forecast


def test_accepted_structured_answers_are_forecast_as_the_work_they_were_accepted_for() -> None:
    """A structured answer accepted as 5 steps with 20 forced rows riding in them is
    that work in the forecasts of the requests after it, while it waits to be handed
    over and while it runs; not 40 tokens a step each, which in a batch of one would
    have the next request miss its deadline. Rows cost: 50 ms a step, 10 ms a row."""
    cost = LinearStepCost.batch(c=0.05, a=0.01, b=0.0, d=0.0)
    idle = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=1)).image()
    stats = EngineStats(now=idle.now, running=0, kv_used=0, kv_capacity=idle.kv_capacity)
    args = {"stats": stats, "queued": 0, "allows_eviction": False, "cached": {}, "image": idle}

    def admission() -> Admission:
        adm = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"))
        adm.recent.least = 10**9  # no load expected beyond what is named here
        return adm

    structured = ask_job(2, 40, idle.now)  # predicted 40 tokens; its grammar's answers: less work
    work = AnswerWork(steps=5, rows=20)
    after = ask_job(3, 5, idle.now)
    # prefill 8 rows + 4 steps with 5 rows riding each, then the next one's 8 + 4 steps
    in_time = (0.05 + 0.08) + 4 * (0.05 + 0.05) + (0.05 + 0.08) + 4 * 0.05
    remembering = admission()
    first = remembering.admit([structured], budget_s=2.0, work=work, **args)  # type: ignore[arg-type]
    assert first.accept
    assert first.predicted_finish_s == pytest.approx(0.13 + 0.4)
    waiting = remembering.admit([after], budget_s=1.5, pending=[structured], **args)  # type: ignore[arg-type]
    assert waiting.accept, waiting.reason
    assert waiting.predicted_finish_s == pytest.approx(in_time)
    # on the engine, not yet started: the same
    sim = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=1, max_time=0.0))
    sim.run([Job(structured.request, output_len=40)])
    on_engine = sim.image()
    assert [s.generated for s in on_engine.seqs] == [0]
    running = remembering.admit([ask_job(4, 5, 0.0)], budget_s=1.5, **{**args, "image": on_engine})  # type: ignore[arg-type]
    assert running.accept
    assert running.predicted_finish_s == pytest.approx(in_time)
    # an admission that never accepted it as structured takes it for 40 steps
    forgetting = admission()
    late = forgetting.admit([after], budget_s=1.5, pending=[structured], **args)  # type: ignore[arg-type]
    assert not late.accept
    assert "5 tokens assumed" in late.reason


def test_what_is_left_of_a_structured_answer_is_its_share_of_steps_and_rows() -> None:
    """Half its tokens made (steps' and riders' alike), half its steps and rows are left,
    the rows spread over the answer's decode steps as ``Job.ride_rows`` counts them."""
    adm = Admission(StepTimer(prior=COST), policy=lambda: make_policy("edf"))
    req = Request(rid=9, arrival=0.0, prompt_len=8, max_tokens=64)
    adm._remember(9, steps=6, rows=18)
    assert adm._assumed(req) == Job(req, output_len=6, ride_rows=18)
    half = adm._assumed(req, generated=12)  # of 6 + 18 tokens
    assert half.output_len == 12 + 3  # 3 steps left
    # 9 rows left over those 3 steps: 3 a step, over the 14 decode steps Job counts
    assert half.ride_rows == 3 * 14
    done = adm._assumed(req, generated=30)  # past what was assumed: one more step
    assert (done.output_len, done.ride_rows) == (31, 0)
    other = Request(rid=10, arrival=0.0, prompt_len=8, max_tokens=64)
    other.predicted = LengthPrediction.exact(20)
    assert adm._assumed(other, generated=4) == Job(other, output_len=20)
