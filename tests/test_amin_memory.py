"""The Eq. 3 memory profile against brute force, memory never exceeded, and restart semantics."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duetime.analysis.amin_model import exact_config, unit_cost
from duetime.core.cost import LinearStepCost
from duetime.core.decision import Decision
from duetime.core.request import Job, LengthPrediction, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.policies import make_policy
from duetime.policies.base import QueuePolicy
from duetime.policies.future_memory import FutureMemory
from duetime.predict.intervals import make_interval_predictor
from duetime.predict.oracle import make_job_predictor
from duetime.sim import SimConfig, Simulator


def brute_use(members: list[tuple[int, int]], k: int) -> int:
    return sum(c + k for r, c in members if k < r)


def brute_fits(members: list[tuple[int, int]], r: int, c: int, cap: int, start: int = 0) -> bool:
    horizon = max([m[0] for m in members] + [0]) + start + r
    return all(
        brute_use(members, k) + (c + k - start if start <= k < start + r else 0) <= cap
        for k in range(horizon + 1)
        if start <= k < start + r
    )


def test_future_memory_matches_brute_force() -> None:
    rnd = random.Random(0)
    for _ in range(300):
        cap = rnd.randint(20, 200)
        members = [(rnd.randint(1, 30), rnd.randint(1, 15)) for _ in range(rnd.randint(0, 8))]
        mem = FutureMemory(cap)
        mem.extend([r for r, _ in members], [c for _, c in members])
        if members:
            assert mem.peak() == max(brute_use(members, k) for k in range(31))
        r, c = rnd.randint(1, 30), rnd.randint(1, 20)
        assert mem.fits(r, c) == brute_fits(members, r, c, cap)
        j = mem.earliest_start(r, c)
        horizon = max([m[0] for m in members] + [0])
        first = next(
            (s for s in range(1, horizon) if brute_fits(members, r, c, cap, start=s)), None
        )
        assert j == first
        if mem.fits(r, c):  # adding one member equals building the set with it
            mem.add(r, c)
            both = FutureMemory(cap)
            both.extend([m[0] for m in [*members, (r, c)]], [m[1] for m in [*members, (r, c)]])
            assert mem.peak() == both.peak()


class Scripted(QueuePolicy):
    """FCFS; restarts request 0 once, after it has made 3 tokens."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__()
        self.done = False

    def schedule(self, snap: EngineSnapshot) -> Decision:
        for s in snap.running:
            if s.rid == 0 and s.generated >= 3 and not self.done:
                self.done = True
                return Decision(preempt=[0], preempt_mode="restart", wake_at=None)
        dec = super().schedule(snap)
        if not self.done:  # be asked again at every step until the restart happened
            dec.wake_at = snap.now + 0.5
        return dec


def test_restart_discards_progress_and_reprefills_only_the_prompt() -> None:
    job = Job(Request(rid=0, arrival=0.0, prompt_len=7), output_len=5)
    cost = LinearStepCost(c0=1.0, a1=0.25)  # a prefill step of the prompt costs 1 + 1.75
    res = Simulator(Scripted(), cost, SimConfig(kv_capacity=100)).run([job])
    rec = res.records[0]
    # Run 1: prefill (2.75) + 2 decode steps → 3 tokens at t = 4.75, then restarted.
    # Run 2: the 7-token prompt again (not prompt + 3) and all 5 tokens again.
    assert rec.first_token == pytest.approx(4.75 + 2.75)
    assert rec.finish == pytest.approx(4.75 + 2.75 + 4)
    assert rec.output_tokens == 5
    assert res.tokens_generated == 3 + 5
    assert res.counters["restarts"] == 1
    assert rec.num_preemptions == 1


def test_a_restart_can_be_readmitted_in_the_same_decision() -> None:
    # A_ℓ names a request it restarts for admission in the same decision: executors apply
    # preempt before prefill, and a restarted request is WAITING by then.
    class Readmit(Scripted):
        def schedule(self, snap: EngineSnapshot) -> Decision:
            dec = super().schedule(snap)
            if dec.preempt:
                dec.prefill.append((0, 0))
            return dec

    job = Job(Request(rid=0, arrival=0.0, prompt_len=7), output_len=5)
    cost = LinearStepCost(c0=1.0, a1=0.25)
    res = Simulator(Readmit(), cost, SimConfig(kv_capacity=100)).run([job])
    rec = res.records[0]
    assert rec.first_token == pytest.approx(4.75 + 2.75)  # the prompt again, at once
    assert rec.finish == pytest.approx(4.75 + 2.75 + 4)
    assert res.tokens_generated == 3 + 5
    assert res.counters["restarts"] == 1


def test_recompute_still_keeps_the_generated_tokens() -> None:
    class Recompute(Scripted):
        def schedule(self, snap: EngineSnapshot) -> Decision:
            dec = super().schedule(snap)
            if dec.preempt:
                dec.preempt_mode = "recompute"
            return dec

    job = Job(Request(rid=0, arrival=0.0, prompt_len=7), output_len=5)
    res = Simulator(Recompute(), LinearStepCost(c0=1.0), SimConfig(kv_capacity=100)).run([job])
    assert res.tokens_generated == 5
    # 3 tokens by t = 3, the re-prefill of prompt + 3 makes the 4th, one decode the 5th.
    assert res.records[0].finish == pytest.approx(3 + 1 + 1)


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[Job], int, str, str, bool]:
    n = draw(st.integers(1, 40))
    jobs, t = [], 0.0
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 3.0]))
        prompt = draw(st.integers(1, 40))
        out = draw(st.integers(1, 60))
        jobs.append(Job(Request(rid=i, arrival=t, prompt_len=prompt), out))
    memory = draw(st.integers(110, 600))
    policy = draw(st.sampled_from(["hsf", "amax", "amin", "aell"]))
    pred = draw(
        st.sampled_from(
            [
                "oracle",
                "interval:rough:1:60",
                "interval:bins:16",
                "interval:overlap:0.9",
                "noisy:0.8",
                "interval:rough:5:20",
            ]  # noisy / [5, 20]: bounds that can be wrong
        )
    )
    linear = draw(st.booleans())
    return jobs, memory, policy, pred, linear


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_memory_is_never_exceeded_and_every_request_ends(
    inst: tuple[list[Job], int, str, str, bool],
) -> None:
    jobs, memory, policy, pred, linear = inst
    cost = LinearStepCost(c0=0.01, a1=1e-4, b=1e-3, d=1e-5) if linear else unit_cost()
    if policy == "hsf" and pred != "oracle":
        pred = "oracle"
    res = Simulator(
        make_policy(policy, seed=3), cost, exact_config(memory), make_job_predictor(pred, seed=1)
    ).run(jobs)  # an overcommitting decision would raise PolicyError
    assert res.kv_peak <= memory
    for rec, job in zip(res.records, jobs, strict=True):
        assert rec.completed or rec.cancelled_at is not None
        if rec.completed:
            assert rec.output_tokens == job.output_len
    assert sum(r.completed for r in res.records) == len(jobs)  # every prompt fits alone


def test_interval_predictors() -> None:
    job = Job(Request(rid=0, arrival=0.0, prompt_len=3), output_len=250)
    assert make_interval_predictor("interval:rough").predict_job(job) == LengthPrediction(
        500.5, 1, 1000
    )
    b = make_interval_predictor("interval:bins10").predict_job(job)
    assert (b.lo, b.hi) == (201, 300)
    o = make_interval_predictor("interval:overlap:0.95").predict_job(job)
    assert (o.lo, o.hi) == pytest.approx((12.5, 487.5))
    assert make_job_predictor("interval:bins:50").predict_job(job).hi == 250  # type: ignore[union-attr]
    for bad in ["interval:nope", "interval:overlap", "interval:overlap:1.5", "interval:rough:9:1"]:
        with pytest.raises(ValueError, match="interval"):
            make_job_predictor(bad)


def test_policies_run_on_the_shipped_profile() -> None:
    from duetime.sim.profiles import load_profile

    cost, cfg = load_profile("a100-llama2-7b")
    cfg = SimConfig(kv_capacity=4000, max_num_seqs=8, max_batch_tokens=300)
    rnd = random.Random(5)
    jobs = [
        Job(Request(rid=i, arrival=i * 0.05, prompt_len=rnd.randint(5, 250)), rnd.randint(1, 90))
        for i in range(60)
    ]
    for policy, pred in [("hsf", "oracle"), ("amax", "interval:bins:32"), ("amin", "noisy")]:
        fresh = [Job(Request(j.request.rid, j.request.arrival, j.request.prompt_len), j.output_len)
                 for j in jobs]  # fmt: skip
        res = Simulator(make_policy(policy), cost, cfg, make_job_predictor(pred)).run(fresh)
        assert all(r.completed for r in res.records)
