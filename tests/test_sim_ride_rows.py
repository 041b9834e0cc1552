"""``Job.ride_rows``: a structured answer's forced runs, computed as extra rows of its
decode steps, charged by the simulator (what a forecast of one adds to its steps)."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator

COST = LinearStepCost(c0=0.02, c_prefill=0.005, a1=2e-4, a2=1e-8, b=1e-3, d=3e-6)


def _job(rid: int, arrival: float, prompt: int, output: int, rows: int) -> Job:
    return Job(Request(rid=rid, arrival=arrival, prompt_len=prompt), output, ride_rows=rows)


class _StepByStep(Simulator):
    """The reference: every decode step taken alone, its riding rows as its prefill rows."""

    def _decode_run(self, horizon_time: float) -> None:
        self._prefill_step([])


def test_one_answer_pays_its_rows_spread_over_its_decode_steps() -> None:
    p, n, rows = 300, 9, 40
    res = Simulator(make_policy("fcfs"), COST).run([_job(0, 1.0, p, n, rows)])
    rec = res.records[0]
    prefill = COST.step_time(p, p * p, 0, 0)  # (no decoder yet: nothing rides)
    share = rows / (n - 1)
    decode = sum(COST.step_time(share, 0, 1, p + i) for i in range(n - 1))
    assert rec.first_token == pytest.approx(1.0 + prefill, rel=1e-12)
    assert rec.finish == pytest.approx(1.0 + prefill + decode, rel=1e-12)
    assert rec.output_tokens == n  # (the steps; the rows are not tokens of its own)
    # the same answer without rows: its steps alone, c_prefill and a1 per row less
    plain = Simulator(make_policy("fcfs"), COST).run([_job(0, 1.0, p, n, 0)]).records[0]
    assert rec.finish - plain.finish == pytest.approx((n - 1) * (COST.c_prefill + COST.a1 * share))


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_decode_runs_charge_the_rows_as_step_by_step_does(policy: str) -> None:
    """Jumping over decode steps (the simulator's speed) charges the riding rows of
    whoever decodes, as they join and leave, exactly as one step at a time does: with
    arrivals mid-run, prefill steps beside decoders and a batch cap that makes requests
    wait."""
    rng = np.random.default_rng(7)
    jobs = [
        _job(
            i,
            float(rng.uniform(0, 2.0)),
            int(rng.integers(5, 200)),
            int(rng.integers(1, 40)),
            int(rng.integers(0, 60)) * int(rng.random() < 0.6),
        )
        for i in range(60)
    ]

    def cfg() -> SimConfig:
        return SimConfig(kv_capacity=100_000, max_num_seqs=8, max_batch_tokens=512)

    fast = Simulator(make_policy(policy), COST, cfg()).run(jobs)
    slow = _StepByStep(make_policy(policy), COST, cfg()).run(jobs)
    assert slow.decode_steps == fast.decode_steps
    for a, b in zip(fast.records, slow.records, strict=True):
        assert a.finish == pytest.approx(b.finish, rel=1e-9, abs=1e-12)
        assert a.first_token == pytest.approx(b.first_token, rel=1e-9, abs=1e-12)
    # and the rows are not free: the same jobs without them end sooner
    bare = [
        _job(j.request.rid, j.request.arrival, j.request.prompt_len, j.output_len, 0) for j in jobs
    ]
    plain = Simulator(make_policy(policy), COST, cfg()).run(bare)
    assert plain.sim_time < fast.sim_time


def test_an_arrival_mid_run_starts_at_the_step_it_would_step_by_step() -> None:
    """A decode run stops at the step that crosses the next arrival; with rows riding,
    its steps are longer, so fewer of them come before it."""
    jobs = [_job(0, 0.0, 50, 400, 4000), _job(1, 0.5, 20, 5, 0), _job(2, 1.7, 20, 5, 0)]
    fast = Simulator(make_policy("fcfs"), COST).run(jobs)
    slow = _StepByStep(make_policy("fcfs"), COST).run(jobs)
    for a, b in zip(fast.records, slow.records, strict=True):
        assert a.first_token == pytest.approx(b.first_token, rel=1e-12)
        assert a.finish == pytest.approx(b.finish, rel=1e-12)


def test_negative_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="ride_rows must be >= 0"):
        _job(0, 0.0, 10, 5, -1)
