"""TimeBill's closed-form α* against a brute-force search on the same estimator."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.core.cost import LinearStepCost
from duetime.policies.timebill_math import (
    decode_phase_time,
    ete_from_cost,
    optimal_eviction_ratio,
    predicted_length,
    wcet_length,
)
from duetime.sim.profiles import load_profile

GRID = np.linspace(0.0, 0.95, 95_001)  # α step 1e-5


def brute_force(budget: float, n_x: int, n_w: int, cost: LinearStepCost) -> float:
    """Smallest α on a fine grid with ETE(prefill + N_W − 1 decode steps) <= T, else α_max."""
    ete = ete_from_cost(cost)
    times = np.asarray(ete.e2e(n_x, n_w, keep_ratio=1.0 - GRID))  # type: ignore[arg-type]
    ok = np.nonzero(times <= budget)[0]
    return float(GRID[ok[0]]) if len(ok) else 0.95


@pytest.mark.parametrize("seed", range(6))
def test_alpha_star_matches_brute_force(seed: int) -> None:
    cost, _ = load_profile("a100-llama2-7b")
    ete = ete_from_cost(cost)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n_x = int(rng.integers(500, 30_000))
        n_w = int(rng.integers(2, 2000))
        lo, hi = ete.e2e(n_x, n_w, 0.05), ete.e2e(n_x, n_w, 1.0)
        budget = float(rng.uniform(lo - 0.2 * (hi - lo), hi + 0.2 * (hi - lo)))
        got = optimal_eviction_ratio(budget, float(ete.prefill(n_x)), n_x, n_w, ete.p, ete.q)
        want = brute_force(budget, n_x, n_w, cost)
        assert got == pytest.approx(want, abs=2e-5)
        if 0.0 < got < 0.95:  # the constraint is tight at α*
            assert ete.e2e(n_x, n_w, 1.0 - got) == pytest.approx(budget, rel=1e-9)


def test_alpha_star_capped_and_zero_when_ample() -> None:
    cost, _ = load_profile("a100-llama2-7b")
    ete = ete_from_cost(cost)
    n_x, n_w = 8000, 500
    t_pre = float(ete.prefill(n_x))
    assert optimal_eviction_ratio(1e-3, t_pre, n_x, n_w, ete.p, ete.q) == 0.95
    ample = ete.e2e(n_x, n_w, 1.0) + 1.0
    assert optimal_eviction_ratio(ample, t_pre, n_x, n_w, ete.p, ete.q) == 0.0
    assert optimal_eviction_ratio(1e-3, t_pre, n_x, 1, ete.p, ete.q) == 0.0  # no decode step
    assert optimal_eviction_ratio(1e-3, t_pre, n_x, n_w, ete.p, ete.q, alpha_max=0.5) == 0.5


def test_ete_mapping_matches_cost_model() -> None:
    cost, _ = load_profile("a100-llama2-7b")
    ete = ete_from_cost(cost)
    assert float(ete.prefill(3000)) == pytest.approx(cost.prefill_time(3000))
    assert float(ete.decode_step(3000)) == pytest.approx(cost.step_time(0, 0.0, 1, 3000))
    # the decode phase is the simulator's arithmetic series for one decoder
    assert decode_phase_time(3000, 101, 0.0, ete.p, ete.q) == pytest.approx(
        cost.decode_span(100, 1, 3000)
    )


def test_ete_round_trip_through_timebill_cost() -> None:
    # c >= q: ete_from_cost inverts LinearStepCost.timebill exactly
    ete = ete_from_cost(LinearStepCost.timebill(a=1e-9, b=1e-4, c=0.02, p=1e-6, q=0.01))
    assert (ete.a, ete.b, ete.c, ete.p, ete.q) == pytest.approx((1e-9, 1e-4, 0.02, 1e-6, 0.01))
    # c < q: timebill() stores c_prefill = max(c - q, 0), so c comes back as max(c, q) = q
    cost = LinearStepCost.timebill(a=1e-9, b=1e-4, c=0.005, p=1e-6, q=0.01)
    assert cost.c_prefill == 0.0
    ete = ete_from_cost(cost)
    assert ete.c == pytest.approx(0.01)
    assert (ete.a, ete.b, ete.p, ete.q) == pytest.approx((1e-9, 1e-4, 1e-6, 0.01))


def test_lengths() -> None:
    assert predicted_length(37.2, 4096) == 38
    assert predicted_length(37.2, 4096, bucket=16) == 48
    assert predicted_length(9000, 4096) == 4096
    assert wcet_length(100, 4096) == 500
    assert wcet_length(1000, 4096) == 4096
    with pytest.raises(ValueError, match="k must be"):
        wcet_length(10, 100, k=0.5)
