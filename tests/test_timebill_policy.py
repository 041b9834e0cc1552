"""TimeBill policy on the simulator: eviction, Kill, Skip-Next, memory."""

from __future__ import annotations

import dataclasses

import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request
from duetime.policies import make_policy
from duetime.predict.oracle import OraclePredictor
from duetime.sim import SimConfig, Simulator
from tests.factories import poisson_jobs

# TimeBill form: prefill aN² + bN + c, decode step p·N_kv + q with a large KV term,
# so eviction visibly shortens decoding.
COST = LinearStepCost.timebill(a=1e-9, b=5e-5, c=0.02, p=2e-6, q=0.01)
CFG = SimConfig(kv_capacity=50_000, max_num_seqs=16, max_batch_tokens=8192)


def _job(rid: int, arrival: float, prompt: int, output: int, budget: float, klass: str = "t0"):
    req = Request(
        rid=rid,
        arrival=arrival,
        prompt_len=prompt,
        max_tokens=2048,
        deadline=arrival + budget,
        klass=klass,
    )
    return Job(request=req, output_len=output)


def _run(jobs: list[Job], **kw: object) -> tuple[Simulator, list]:
    sim = Simulator(make_policy("timebill", **kw), COST, CFG, predictor=OraclePredictor())
    res = sim.run(jobs)
    return sim, res.records


def test_registered_with_baseline_parameters() -> None:
    assert make_policy("timebill", fixed_alpha=0.5).fixed_alpha == 0.5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="overrun must be"):
        make_policy("timebill", overrun="drop")
    with pytest.raises(ValueError, match="fixed_alpha"):
        make_policy("timebill", fixed_alpha=1.0)


def test_eviction_reduces_finish_time() -> None:
    def finish(alpha: float) -> float:
        _, recs = _run([_job(0, 0.0, 10_000, 300, 100.0)], fixed_alpha=alpha)
        assert recs[0].kv_evicted_ratio == alpha
        return recs[0].finish

    f0, f50, f95 = finish(0.0), finish(0.5), finish(0.95)
    assert f0 > f50 > f95
    # decode steps read 10,000 → 5,000 KV tokens: 299 steps × 5,000 × p saved
    assert f0 - f50 == pytest.approx(299 * 5000 * 2e-6, rel=1e-6)


def test_alpha_star_meets_a_tight_budget_that_vanilla_misses() -> None:
    job = _job(0, 0.0, 10_000, 300, 1000.0)
    vanilla_e2e = _run([job], fixed_alpha=0.0)[1][0].finish
    budget = 0.9 * vanilla_e2e
    _, recs = _run([_job(0, 0.0, 10_000, 300, budget)], fixed_alpha=0.0)
    assert recs[0].finish is None
    assert recs[0].cancelled_at is not None
    _, recs = _run([_job(0, 0.0, 10_000, 300, budget)], k=1.0)  # oracle length, WCET = truth
    rec = recs[0]
    assert 0.0 < rec.kv_evicted_ratio < 0.95
    assert rec.finish is not None
    assert rec.finish <= budget
    assert budget - rec.finish < 0.02  # the least eviction that fits: finishes just in time
    # ample budget: no eviction at all
    _, recs = _run([_job(0, 0.0, 10_000, 300, 10 * vanilla_e2e)])
    assert recs[0].kv_evicted_ratio == 0.0
    assert recs[0].completed


def _run_cost(cost: LinearStepCost, jobs: list[Job], **kw: object) -> list:
    sim = Simulator(make_policy("timebill", **kw), cost, CFG, predictor=OraclePredictor())
    return sim.run(jobs).records


def test_simulator_charges_the_eviction_time_once() -> None:
    job = _job(0, 0.0, 10_000, 300, 100.0)
    free = _run_cost(COST, [job], fixed_alpha=0.5)[0].finish
    costly = dataclasses.replace(COST, e=1e-5)  # 10,000 tokens held: 0.1 s per eviction
    paid = _run_cost(costly, [job], fixed_alpha=0.5)[0].finish
    assert paid - free == pytest.approx(10_000 * 1e-5, rel=1e-9)
    # no eviction, nothing charged
    assert (
        _run_cost(costly, [job], fixed_alpha=0.0)[0].finish
        == _run_cost(COST, [job], fixed_alpha=0.0)[0].finish
    )


def test_alpha_star_pays_for_the_eviction_or_does_not_evict() -> None:
    job = _job(0, 0.0, 10_000, 300, 1000.0)
    vanilla = _run([job], fixed_alpha=0.0)[1][0].finish
    budget = 0.95 * vanilla  # vanilla misses by 5 %: eviction can save up to ~5.98 s × α
    # cheap eviction (0.1 s): still evicts, a bit more than the paper's α* to pay for itself
    paper = _run([_job(0, 0.0, 10_000, 300, budget)], k=1.0)[1][0]
    cheap = _run_cost(
        dataclasses.replace(COST, e=1e-5), [_job(0, 0.0, 10_000, 300, budget)], k=1.0
    )[0]
    assert 0.0 < paper.kv_evicted_ratio < cheap.kv_evicted_ratio < 0.95
    assert cheap.finish is not None
    assert cheap.finish <= budget
    # eviction costing more than any ratio can save (10 s vs <= 5.7 s): keep the full KV
    dear = dataclasses.replace(COST, e=1e-3)
    rec = _run_cost(dear, [_job(0, 0.0, 10_000, 300, budget)], k=1.0)[0]
    assert rec.kv_evicted_ratio == 0.0
    # an ample budget never evicts, whatever eviction costs
    rec = _run_cost(dear, [_job(0, 0.0, 10_000, 300, 2 * vanilla)], k=1.0)[0]
    assert rec.kv_evicted_ratio == 0.0
    assert rec.completed


def test_eviction_coefficient_round_trips_through_a_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    cost = dataclasses.replace(COST, e=2.5e-4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(cost.to_profile()))
    assert LinearStepCost.from_profile(path).e == 2.5e-4
    assert cost.eviction_time(400) == pytest.approx(0.1)


def test_kill_cancels_at_the_deadline_step_and_frees_memory() -> None:
    jobs = [_job(0, 0.0, 5000, 2000, 1.0), _job(1, 0.5, 100, 20, 5.0, klass="t1")]
    sim, recs = _run(jobs, fixed_alpha=0.0)
    killed = recs[0]
    assert killed.finish is None
    assert killed.cancelled_at is not None
    step = COST.step_time(0, 0.0, 2, 5000 + 2000)  # an upper bound on one step here
    assert 1.0 <= killed.cancelled_at < 1.0 + step  # the end of the step that crosses it
    assert 0 < killed.output_tokens < 2000
    assert recs[1].completed
    assert recs[1].deadline_met
    assert sim.kv_used == 0
    assert sim.counters["cancelled"] == 1


def test_skip_next_skips_released_jobs_while_the_task_overruns() -> None:
    period = 1.0
    jobs = [
        _job(0, 0.0, 2000, 150, period),  # ~2.3 s: overruns two releases
        _job(1, 1.0, 100, 10, period),  # released while job 0 overruns: skipped
        _job(2, 2.0, 100, 10, period),  # still overrunning at t = 2: skipped
        _job(3, 3.0, 100, 10, period),  # job 0 done by now: runs
        _job(4, 1.0, 100, 10, period, klass="other"),  # another task: unaffected
    ]
    _, records = _run(jobs, fixed_alpha=0.0, overrun="skip-next")
    recs = {r.request.rid: r for r in records}
    first = recs[0]
    assert first.completed
    assert not first.deadline_met
    assert 2.0 < first.finish < 3.0
    for r in (recs[1], recs[2]):
        assert r.finish is None
        assert r.first_token is None
        assert r.request.arrival <= r.cancelled_at < r.request.arrival + 0.05
    assert recs[3].completed
    assert recs[3].deadline_met
    assert recs[4].completed
    assert recs[4].deadline_met


def test_skip_next_job_waits_while_the_earlier_one_is_on_time() -> None:
    # deadlines longer than the period: job 1 is released while job 0 runs but is not late
    jobs = [_job(0, 0.0, 2000, 100, 5.0), _job(1, 0.5, 100, 10, 5.0)]
    _, recs = _run(jobs, fixed_alpha=0.0, overrun="skip-next")
    assert all(r.completed and r.deadline_met for r in recs)


@pytest.mark.parametrize("overrun", ["kill", "skip-next"])
@pytest.mark.parametrize("alpha", [None, 0.0, 0.5])
def test_memory_never_exceeded(overrun: str, alpha: float | None) -> None:
    jobs = poisson_jobs(300, rate=20.0, seed=3, prompt=(200, 3000), output=(5, 400), slo=3.0)
    jobs = [
        dataclasses.replace(
            j, request=dataclasses.replace(j.request, klass=f"t{j.request.rid % 4}")
        )
        for j in jobs
    ]
    cfg = SimConfig(kv_capacity=12_000, max_num_seqs=16, max_batch_tokens=4096)
    pol = make_policy("timebill", fixed_alpha=alpha, overrun=overrun)
    sim = Simulator(pol, COST, cfg, predictor=OraclePredictor())
    res = sim.run(jobs)
    assert res.kv_peak <= cfg.kv_capacity
    assert sim.kv_used == 0
    assert all(r.completed or r.cancelled_at is not None for r in res.records)
    if overrun == "kill":
        assert all(r.finish is None or r.finish <= r.request.deadline + 0.1 for r in res.records)


@pytest.mark.parametrize("own", [0.5, 0.9])
def test_a_requests_own_ratio_is_passed_on_as_given(own: float) -> None:
    """α* is rounded up to whole tokens; a ratio the client fixed is not (it was: 0.5 → 0.52)."""
    job = _job(0, 0.0, 51, 40, 0.5)
    job.request.kv_eviction = own
    _, recs = _run([job])
    assert recs[0].kv_evicted_ratio == own
