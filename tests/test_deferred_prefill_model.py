"""Deferred prefill: Theorem 1 against hand values, brute force and the simulator; the policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from duetime.analysis.deferred_prefill import (
    DeferredPrefillModel,
    advise,
    cycle_moments,
    departure_alpha,
)
from duetime.bench.deferred_prefill import geometric_jobs, measure
from duetime.cli import app
from duetime.core.cost import LinearStepCost
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator


def test_cycle_moments_by_hand() -> None:
    a = 0.2
    # C = 1: the one request leaves after a Geometric(α) number of steps.
    assert cycle_moments(1, a, 1) == pytest.approx((1 / a, 0.0))
    # C = 2, K = 1: stay at 2 w.p. (1 − α)², else stop at 1 (2α(1 − α)) or 0 (α²).
    en, ex = cycle_moments(2, a, 1)
    assert en == pytest.approx(1 / (1 - (1 - a) ** 2))
    assert ex == pytest.approx(2 * (1 - a) / (2 - a))
    # K = C: wait for all of them, E N = E max of C geometrics.
    en, ex = cycle_moments(2, a, 2)
    q = 1 - a
    assert en == pytest.approx(sum(1 - (1 - q**j) ** 2 for j in range(2000)))
    assert ex == 0.0


def test_cycle_moments_against_monte_carlo() -> None:
    rng = np.random.default_rng(0)
    c, a, runs = 20, 0.1, 40_000
    for k in (1, 5, 20):
        x = np.full(runs, c)
        steps = np.zeros(runs)
        live = x > c - k
        while live.any():
            x[live] = rng.binomial(x[live], 1 - a)
            steps[live] += 1
            live = x > c - k
        en, ex = cycle_moments(c, a, k)
        assert steps.mean() == pytest.approx(en, rel=0.02)
        assert x.mean() == pytest.approx(ex, abs=0.05)


MODEL = DeferredPrefillModel(
    capacity=16, alpha=0.1, c_p=0.05, prefill_per_prompt=0.002, c_d=0.01, t_d=0.001
)


def test_theorem_1_and_proposition_1() -> None:
    one = DeferredPrefillModel(1, 0.25, c_p=0.3, prefill_per_prompt=0.1, c_d=0.02, t_d=0.01)
    assert one.throughput(1) == pytest.approx(1 / (0.3 + 0.1 + (0.02 + 0.01) / 0.25))
    m = MODEL
    rho = [m.throughput(k) for k in range(1, 17)]
    assert m.optimal_k() == 1 + int(np.argmax(rho))
    inv = [1 / m.throughput_approx(k) for k in range(1, 16)]
    assert all(np.diff(inv, 2) > 0)  # convex: one minimiser (Remark 2)
    assert m.optimal_k_approx() == 1 + int(np.argmin(inv))
    assert m.throughput_approx(1) == pytest.approx(
        1 / (m.c_p + m.c_d * math.log(1 - 1 / 16) / math.log(0.9) + m.t_d / 0.1 + 0.002)
    )
    # With no switching overhead, prefilling at every departure is best (Remark 2).
    assert DeferredPrefillModel(16, 0.1, 0.0, 0.002, 0.01, 0.001).optimal_k_approx() == 1


def test_from_cost_reads_the_profile() -> None:
    cost = LinearStepCost(c0=0.01, c_prefill=0.002, a1=1e-4, a2=1e-8, b=5e-5, d=1e-7)
    m = DeferredPrefillModel.from_cost(cost, capacity=64, mean_output=101, prompt_len=200)
    assert m.alpha == pytest.approx(0.01)
    assert (m.c_p, m.c_d) == pytest.approx((0.012, 0.01))
    assert m.prefill_per_prompt == pytest.approx(1e-4 * 200 + 1e-8 * 200**2)
    assert m.t_d == pytest.approx(5e-5 + 1e-7 * (200 + 99))
    back = m.to_cost(200)
    assert back.step_time(400, 0.0, 0, 0) == pytest.approx(m.c_p + 2 * m.prefill_per_prompt)
    assert back.decode_span(1, 10, 0) == pytest.approx(m.c_d + 10 * m.t_d)


def test_simulator_agrees_with_theorem_1() -> None:
    # Within 2.5 %: over ~3,000 departures the renewal-reward estimate has a
    # relative error of about 1 % (stratified geometric lengths remove most of the
    # sampling error of their mean; what is left is the cycle-to-cycle noise).
    cost = MODEL.to_cost(100)
    jobs = geometric_jobs(3000, MODEL.alpha, 100, seed=0)
    sim = {k: measure(jobs, cost, 16, k)["throughput_req_s"] for k in (1, 4, 9, 16)}
    for k, rho in sim.items():
        assert rho == pytest.approx(MODEL.throughput(k), rel=0.025), k
    assert MODEL.optimal_k() == 9
    assert max(sim, key=sim.__getitem__) == 9
    assert sim[9] / sim[1] - 1 == pytest.approx(
        MODEL.throughput(9) / MODEL.throughput(1) - 1, abs=0.03
    )


def test_policy_waits_for_k_departures_and_stalls_decode() -> None:
    jobs = geometric_jobs(200, 0.2, 10, seed=1)
    cost = LinearStepCost(c0=1.0)
    cfg = SimConfig(kv_capacity=1 << 30, max_num_seqs=8, max_batch_tokens=1 << 30)
    res = Simulator(make_policy("deferred-prefill", k=3), cost, cfg).run(jobs)
    firsts = sorted({r.first_token for r in res.records})
    sizes = [sum(r.first_token == t for r in res.records) for t in firsts]
    assert sizes[0] == 8
    assert all(s >= 3 for s in sizes[1:-1])  # refills of at least K (the last may be short)
    # A prefill step decodes nothing: steps = decode steps + prefill steps.
    assert res.engine_steps == res.decode_steps + len(firsts)
    assert all(r.completed for r in res.records)


def test_advise_cli_prints_and_writes_k_star(tmp_path: Path) -> None:
    j = tmp_path / "a.json"
    r = CliRunner().invoke(
        app,
        [
            "advise",
            "deferred-prefill",
            "--capacity",
            "64",
            "--mean-output",
            "150",
            "--prompt-len",
            "200",
            "--json",
            str(j),
        ],
    )
    assert r.exit_code == 0, r.output
    got = json.loads(j.read_text())
    assert f"K* = {got['k_star']}" in r.output
    assert 1 <= got["k_star"] <= 64
    assert got["throughput_k_star_req_s"] >= got["throughput_k1_req_s"]
    bad = CliRunner().invoke(app, ["advise", "deferred-prefill", "--capacity", "8",
                                   "--mean-output", "1"])  # fmt: skip
    assert bad.exit_code == 2
    assert "mean output" in bad.output


def test_advise_matches_model() -> None:
    adv = advise(MODEL)
    assert adv["k_star"] == 9
    assert adv["gain_vs_k1_pct"] == pytest.approx(
        100 * (MODEL.throughput(9) / MODEL.throughput(1) - 1)
    )
    ka = adv["k_star_approx"]
    assert adv["theorem1_gain_at_k_star_approx_pct"] == pytest.approx(
        100 * (MODEL.throughput(ka) / MODEL.throughput(1) - 1)
    )
    assert adv["prop1_gain_pct"] == pytest.approx(
        100 * (MODEL.throughput_approx(ka) / MODEL.throughput_approx(1) - 1)
    )


def test_advise_cli_tells_prop1_gain_from_theorem1_gain(tmp_path: Path) -> None:
    """C = 256, mean output 320: the line labelled Prop. 1 printed +6.05 %, Theorem 1's
    gain at Prop. 1's K*; Prop. 1's own prediction is +9.18 %."""
    j = tmp_path / "a.json"
    r = CliRunner().invoke(app, ["advise", "deferred-prefill", "--capacity", "256",
                                 "--mean-output", "320", "--json", str(j)])  # fmt: skip
    assert r.exit_code == 0, r.output
    adv = json.loads(j.read_text())
    assert adv["k_star"] == adv["k_star_approx"] == 21
    assert adv["gain_vs_k1_pct"] == pytest.approx(6.05, abs=0.005)
    assert adv["theorem1_gain_at_k_star_approx_pct"] == pytest.approx(6.05, abs=0.005)
    assert adv["prop1_gain_pct"] == pytest.approx(9.18, abs=0.005)
    assert "gain_vs_k1_approx_pct" not in adv  # the old, mislabelled key
    text = " ".join(r.output.split())  # rich wraps long lines
    assert "approximation (Prop. 1): K* = 21, predicts ρ(K*) = 8.411 req/s, +9.18 %" in text
    assert "Theorem 1 at Prop. 1's K* = 21: ρ = 8.413 req/s, +6.05 %" in text


@pytest.mark.parametrize("mean", ["1.2", "1.999", "nan"])
def test_advise_refuses_a_mean_output_under_two_tokens(mean: str) -> None:
    """1.2 was clamped to α = 1 and printed "1/α = 1.0 decode steps", exit 0."""
    r = CliRunner().invoke(app, ["advise", "deferred-prefill", "--capacity", "8",
                                 "--mean-output", mean])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "--mean-output" in r.output
    assert ">= 2" in r.output
    assert "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="--mean-output"):
        departure_alpha(float(mean))


def test_two_tokens_is_one_decode_step_and_prop1_takes_one_step_cycles() -> None:
    """Mean output 2 gives α = 1: every request leaves after its one decode step, so a
    cycle is one step (the exact chain agrees), where Prop. 1's ln(1 − K/C)/ln(1 − α) is 0."""
    assert departure_alpha(2.0) == 1.0
    assert cycle_moments(16, 1.0, 5) == pytest.approx((1.0, 0.0))
    m = DeferredPrefillModel(16, 1.0, c_p=0.05, prefill_per_prompt=0.002, c_d=0.01, t_d=0.001)
    assert m.throughput_approx(4) == pytest.approx(1 / ((0.05 + 0.01) / 4 + 0.001 + 0.002))


@pytest.mark.parametrize("stall", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_a_request_that_outgrows_memory_is_cancelled_not_a_deadlock(k: int, stall: bool) -> None:
    """1 + 5 tokens in a 4-token KV: preempted at 4, it could never be admitted again, and
    the run stopped with "scheduled nothing ... would never end" (found by property tests)."""
    from duetime.core.request import Job, Request

    jobs = [
        Job(Request(rid=0, arrival=0.0, prompt_len=1, max_tokens=5), output_len=5),
        Job(Request(rid=1, arrival=0.1, prompt_len=1, max_tokens=2), output_len=2),
    ]
    policy = make_policy("deferred-prefill", k=k, stall_decode=stall)
    cfg = SimConfig(kv_capacity=4, max_num_seqs=4, max_batch_tokens=64)
    res = Simulator(policy, LinearStepCost(c0=0.01, b=0.001), cfg).run(jobs)
    big, small = sorted(res.records, key=lambda r: r.request.rid)
    assert big.finish is None
    assert big.cancelled_at is not None
    assert small.finish is not None
    assert small.output_tokens == 2
