"""H-SF, Amax, Amin and A_ℓ on the paper's exact model: its examples, its adversarial instance."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.analysis.amin_model import exact_config, paper_jobs, theorem2_ratio, unit_cost
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.sim import SimResult, Simulator


def run(policy: str, outputs: list[int], memory: int, predictor: str, s: int = 0, seed: int = 0):
    res = Simulator(
        make_policy(policy, seed=seed),
        unit_cost(),
        exact_config(memory),
        make_job_predictor(predictor),
    ).run(paper_jobs(outputs, s))
    assert all(r.completed for r in res.records)
    assert res.kv_peak <= memory
    return res


def tel(res: SimResult) -> float:
    return sum(r.e2e for r in res.records)  # type: ignore[misc]


def test_example_1_amax_wastes_memory_on_upper_bounds() -> None:
    # Sec. 3.2, Example 1: n = 5, s = 1, o_i = 1, M = 10, interval [1, 4].
    assert tel(run("hsf", [1] * 5, 10, "oracle", s=1)) == 5  # all five at once
    assert tel(run("amax", [1] * 5, 10, "interval:rough:1:4", s=1)) == 1 + 1 + 2 + 2 + 3
    assert tel(run("amin", [1] * 5, 10, "interval:rough:1:4", s=1)) == 5


def test_theorem_2_instance_separates_amax_from_amin() -> None:
    # s = 0, M = ℓu, a·u jobs of length ℓ and b·ℓ of length u, a/b = α^½ (ℓ = 1, u = 16).
    ell, u, a, b = 1, 16, 4, 16
    outs = [ell] * (a * u) + [u] * (b * ell)
    hsf = tel(run("hsf", outs, ell * u, "oracle"))
    # H-SF: a rounds of u short jobs, then the long ones ℓ at a time.
    assert hsf == u * ell * a * (a + 1) / 2 + b * ell * a * ell + u * ell * b * (b + 1) / 2
    spec = f"interval:rough:{ell}:{u}"
    amax = [tel(run("amax", outs, ell * u, spec, seed=k)) for k in range(24)]
    # Amax sees every job as u = M: one at a time in random order, E[TEL] = Σo·(n + 1)/2.
    expected = sum(outs) * (len(outs) + 1) / 2
    assert np.mean(amax) == pytest.approx(expected, rel=0.06)
    amin = np.mean([tel(run("amin", outs, ell * u, spec, seed=k)) for k in range(6)])
    assert expected / hsf == pytest.approx(5.4)
    assert theorem2_ratio(ell, u, a, b) == pytest.approx(40 / 7)  # first order, a, b → ∞
    assert np.mean(amax) / hsf > 4.5
    assert amin / hsf < 1.8  # Theorem 6: (3 − α)/2 + O(1/M) with M = 16


def test_hsf_waits_until_the_future_fits_eq3() -> None:
    # Two jobs of 6 tokens, M = 10: both fit now (2 tokens) but would need 12 at step 5.
    res = run("hsf", [6, 6], 10, "oracle")
    first, second = sorted(res.records, key=lambda r: r.first_token or 0)
    assert (first.first_token, first.finish) == (1.0, 6.0)
    # Started at step 2 it peaks with the first job at 6 + 4 = 10 tokens: the earliest fit.
    assert (second.first_token, second.finish) == (3.0, 8.0)
    assert res.preemptions == 0


@pytest.mark.parametrize("policy", ["hsf", "amax"])
def test_exact_knowledge_never_cancels(policy: str) -> None:
    rng = np.random.default_rng(3)
    outs = rng.integers(1, 60, 120).tolist()
    res = run(policy, outs, 600, "oracle" if policy == "hsf" else "interval:overlap:0.5", s=5)
    assert res.counters.get("restarts", 0) == 0


def test_amin_raises_bounds_and_restarts_from_scratch() -> None:
    rng = np.random.default_rng(1)
    outs = rng.integers(1, 80, 150).tolist()
    res = run("amin", outs, 400, "interval:rough:1:100", s=3)
    assert res.counters["restarts"] > 0
    # A restart discards the tokens made: the engine produced more than the answers hold.
    assert res.tokens_generated > sum(outs)
    for rec, o in zip(res.records, outs, strict=True):
        assert rec.output_tokens == o
        # A restarted request's first token is that of its last run, o − 1 steps before the end.
        assert rec.finish - rec.first_token == o - 1


def test_amin_cancels_the_smallest_bound_and_requeues_it_behind() -> None:
    pol = make_policy("amin", seed=0)
    # Two long jobs (bound 1) fill M = 12 after a few steps; one is cancelled, its bound
    # becomes what it made, and the short third job (bound 1) goes before it.
    res = Simulator(pol, unit_cost(), exact_config(12), make_job_predictor("interval:rough:1:9"))
    bounds_at_end: dict[int, int] = {}  # the executor has the policy forget each as it ends
    forget = pol.forget  # type: ignore[attr-defined]

    def remember(rid: int) -> None:
        bounds_at_end[rid] = pol._bound.get(rid, 0)  # type: ignore[attr-defined]
        forget(rid)

    pol.forget = remember  # type: ignore[attr-defined]
    out = res.run(paper_jobs([9, 9, 1], s=1))
    assert out.counters["restarts"] >= 1
    assert sorted(bounds_at_end) == [0, 1, 2]
    raised = [b for b in bounds_at_end.values() if b > 1]
    assert raised
    assert pol._bound == {}  # type: ignore[attr-defined]
    short = out.records[2]
    assert short.finish is not None
    assert short.finish <= 9


def test_aell_promotes_long_jobs_once() -> None:
    res = run("aell", [2, 8, 2, 8, 2], 16, "interval:rough:2:8")
    assert [r.finish for r in res.records] == [2.0, 10.0, 2.0, 10.0, 2.0]
    assert res.counters["restarts"] == 2  # each long job, once, at ℓ = 2 tokens
    assert [r.num_preemptions for r in res.records] == [0, 1, 0, 1, 0]


def test_aell_readmits_a_promoted_job_in_the_same_step() -> None:
    # Alg. 6 moves a promoted job "to the end of R_t" and fills the batch from R_t in the
    # same step. ℓ = 8, u = 13, s = 2, M = 85: at t = 8 the three short jobs of the first
    # batch are done and the four long ones are promoted; job 8 (started at 5) still runs,
    # and the four fit next to it, so they start again at t = 8, not when job 8 ends at 13.
    outs = [8, 8, 8, 13, 13, 13, 13, 8, 8]
    res = run("aell", outs, 85, "interval:rough:8:13", s=2)
    longs = [r for r, o in zip(res.records, outs, strict=True) if o == 13]
    assert [(r.first_token, r.finish, r.num_preemptions) for r in longs] == [(9.0, 21.0, 1)] * 4
    assert res.records[8].first_token == 6.0  # (admitted at 5: first token after one step)
    assert tel(res) == 129  # the per-step Alg. 6 reference; 149 when they waited for t = 13


def test_amin_readmits_an_evicted_job_at_the_next_step() -> None:
    # Two jobs, bound 1, s = 1, M = 7: at t = 2 the next step would need 2·4 = 8 tokens,
    # so job 1 is cancelled (õ ← 2). It rejoins R_t for t = 3, where it fits next to
    # job 0 (3 + 1 + 1 tokens, assumed to end now) with its 1 + 1: it restarts then, not
    # when job 0 ends at t = 4 (an event the call would otherwise have waited for).
    res = run("amin", [4, 3], 7, "interval:rough:1:6", s=1)
    assert [(r.first_token, r.finish) for r in res.records] == [(1.0, 4.0), (4.0, 6.0)]
    assert res.counters["restarts"] == 1
    assert tel(res) == 10


def test_two_point_ratios_respect_theorems_6_and_7() -> None:
    from duetime.analysis.amin_model import aell_bound, amin_two_point_bound

    rng = np.random.default_rng(0)
    ell, u, n, memory = 10, 100, 300, 1000
    outs = np.where(rng.random(n) < 0.5, ell, u).tolist()
    spec = f"interval:rough:{ell}:{u}"
    base = tel(run("hsf", outs, memory, "oracle"))
    alpha = ell / u
    aell = tel(run("aell", outs, memory, spec)) / base
    amin = tel(run("amin", outs, memory, spec)) / base
    assert aell <= aell_bound(alpha) + 0.05
    assert amin <= amin_two_point_bound(alpha) + 0.05
    assert aell < amin  # α = 0.1 < α* ≈ 0.38: promote-ℓ wins
