"""The simulator against numbers we can compute by hand."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator
from tests.factories import SIMPLE_COST, job, poisson_jobs


def test_single_request_takes_prefill_plus_decode_cost() -> None:
    cost = LinearStepCost.timebill(a=1e-7, b=2e-4, c=0.03, p=3e-6, q=0.02)
    res = Simulator(make_policy("fcfs"), cost).run([job(0, arrival=2.0, prompt=300, output=40)])
    rec = res.records[0]
    prefill = 1e-7 * 300**2 + 2e-4 * 300 + 0.03  # TimeBill Eq.: aN² + bN + c
    decode = sum(3e-6 * (300 + i) + 0.02 for i in range(39))  # p·N_kv + q per step
    assert rec.first_token == pytest.approx(2.0 + prefill, rel=1e-12)
    assert rec.finish == pytest.approx(2.0 + prefill + decode, rel=1e-12)
    assert rec.output_tokens == 40
    assert res.decode_steps == 39


def test_one_token_answer_finishes_at_prefill() -> None:
    res = Simulator(make_policy("fcfs"), SIMPLE_COST).run([job(0, prompt=50, output=1)])
    rec = res.records[0]
    assert rec.finish == rec.first_token == pytest.approx(SIMPLE_COST.prefill_time(50))
    assert res.decode_steps == 0


def test_saturated_fcfs_runs_in_exact_waves() -> None:
    """All requests at t=0, batch cap B: the run is N/B identical waves."""
    b, p, o, waves = 8, 64, 30, 5
    jobs = [job(i, 0.0, p, o) for i in range(b * waves)]
    cfg = SimConfig(kv_capacity=10**6, max_num_seqs=b, max_batch_tokens=10**5)
    res = Simulator(make_policy("fcfs"), SIMPLE_COST, cfg).run(jobs)
    wave = SIMPLE_COST.step_time(b * p, b * p * p, 0, 0) + SIMPLE_COST.decode_span(o - 1, b, b * p)
    assert res.sim_time == pytest.approx(waves * wave, rel=1e-9)
    tput = sum(r.output_tokens for r in res.records) / res.sim_time
    assert tput == pytest.approx(b * o / wave, rel=1e-9)


def test_decode_steps_within_is_the_inverse_of_decode_span() -> None:
    cost = SIMPLE_COST
    for d, kv in [(1, 0), (7, 1000), (128, 50_000)]:
        for horizon in [0.0, 0.005, 0.1, 3.7, 120.0]:
            k = cost.decode_steps_within(horizon, d, kv)
            assert cost.decode_span(k, d, kv) <= horizon * (1 + 1e-12)
            assert cost.decode_span(k + 1, d, kv) > horizon


def test_littles_law_on_a_long_run() -> None:
    """L (time-average in system, integrated by the simulator) = λ·W (from the records)."""
    jobs = poisson_jobs(20_000, rate=20.0, seed=3)
    cfg = SimConfig(kv_capacity=60_000, max_num_seqs=128)
    res = Simulator(make_policy("fcfs"), SIMPLE_COST, cfg).run(jobs)
    e2e = np.array([r.e2e for r in res.records])
    lam = len(jobs) / res.sim_time
    assert res.mean_in_system == pytest.approx(lam * e2e.mean(), rel=0.02)
    assert res.mean_in_system > 5  # the check means something only with a real queue


def test_memory_pressure_preempts_newest_and_still_finishes_everything() -> None:
    jobs = [job(i, 0.001 * i, 100, 200) for i in range(20)]
    cfg = SimConfig(kv_capacity=1500, max_num_seqs=64)
    res = Simulator(make_policy("fcfs"), SIMPLE_COST, cfg).run(jobs)
    assert res.preemptions > 0
    assert res.kv_peak <= 1500
    assert all(r.finish is not None and r.output_tokens == 200 for r in res.records)
    # vLLM behaviour: the oldest request is never the one preempted first.
    assert res.records[0].num_preemptions == 0


def test_swap_preemption_costs_transfer_time_and_keeps_tokens() -> None:
    jobs = [job(i, 0.001 * i, 100, 200) for i in range(20)]
    cfg = SimConfig(kv_capacity=1500, max_num_seqs=64)
    swap_cost = LinearStepCost(c0=0.01, a1=1e-4, b=1e-4, d=1e-6, s=1e-3)
    res = Simulator(make_policy("fcfs", preempt_mode="swap"), swap_cost, cfg).run(jobs)
    assert res.counters["swaps"] > 0
    assert all(r.output_tokens == 200 for r in res.records)
    free = LinearStepCost(c0=0.01, a1=1e-4, b=1e-4, d=1e-6, s=0.0)
    res0 = Simulator(make_policy("fcfs", preempt_mode="swap"), free, cfg).run(jobs)
    assert res.sim_time > res0.sim_time  # the transfers cost time


def test_prompt_larger_than_memory_is_rejected_not_hung() -> None:
    cfg = SimConfig(kv_capacity=100)
    res = Simulator(make_policy("fcfs"), SIMPLE_COST, cfg).run([job(0, prompt=500), job(1)])
    assert res.records[0].cancelled_at is not None
    assert res.records[0].finish is None
    assert res.records[1].finish is not None
    assert res.counters["rejected"] == 1
