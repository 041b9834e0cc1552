"""TimelyLLM: TUF / PUD values from the paper's formulas, the policy's choices, simulator runs."""

from __future__ import annotations

import math

import pytest

from duetime.bench.timelyllm import overhead, overhead_snapshot, paper_rtx4090, robot_outcome
from duetime.core.request import Job, Request
from duetime.core.sequence import DecodeClock, Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.policies import make_policy
from duetime.policies.pud import pud_priority
from duetime.sim import Simulator
from duetime.workloads.lrtrace import TUF_NORMAL, TUF_URGENT, lrtrace_jobs


def test_tuf_values_match_eq1_and_paper_parameters() -> None:
    assert TUF_NORMAL(0.5) == 1.0  # before ERT: β
    assert TUF_NORMAL(1.25) == pytest.approx(0.5)  # 1 − 2·0.25
    assert TUF_NORMAL(1.5) == pytest.approx(0.0)  # the paper's 1.5 s cut-off
    assert TUF_URGENT(0.2) == 2.0
    assert TUF_URGENT(0.5) == pytest.approx(0.0, abs=1e-12)  # cut-off 0.5 s
    tuf1 = TUF_NORMAL.later_segment()
    assert tuf1(-3.0) == 1.0  # early: clipped to β
    assert tuf1(0.2) == pytest.approx(0.6)


def test_pud_priority_eq4_hand_cases() -> None:
    # k = 0, normal: W = 0.5 + 0.1 = 0.6 -> TUF0 = 1; L = 1 − 0.5 − 0.1 = 0.4; 1 / (0.1·0.4) = 25
    assert pud_priority(TUF_NORMAL, 0, 0.5, 0.1, 0.0, 0.0, 0.01) == pytest.approx(25.0)
    # k = 0, urgent: W = 0.2 -> TUF0 = β = 2; slack 0 floored at 0.01: 2 / (0.1·0.01) = 2000
    assert pud_priority(TUF_URGENT, 0, 0.1, 0.1, 0.0, 0.0, 0.01) == pytest.approx(2000.0)
    # k = 1 (δ = 0): W = 3 + 0.1 − 2.9 = 0.2 -> TUF1 = 0.6; slack floored: 0.6 / 0.001 = 600
    assert pud_priority(TUF_NORMAL, 1, 3.0, 0.1, 0.0, 2.9, 0.01) == pytest.approx(600.0)
    # k = 1 well before ready: TUF1 = β, L = 2.0 − 0 − 0.1 = 1.9
    assert pud_priority(TUF_NORMAL, 1, 0.0, 0.1, 0.0, 2.0, 0.01) == pytest.approx(1 / (0.1 * 1.9))


def _snap(
    waiting: list[Seq], suspended: list[Seq], now: float, max_num_seqs: int
) -> EngineSnapshot:
    return EngineSnapshot(
        now=now,
        waiting=waiting,
        running=[],
        prefilling=[],
        suspended=suspended,
        kv_capacity=10_000,
        kv_free=10_000 - sum(s.kv_tokens for s in suspended),
        max_num_seqs=max_num_seqs,
        max_batch_tokens=4096,
    )


def test_ready_segment_resumes_before_lower_priority_new_request() -> None:
    clock = DecodeClock()
    old = Seq(Request(rid=0, arrival=0.0, prompt_len=100, tuf=TUF_NORMAL), clock, 0)
    old.status, old.prefilled, old.segment_index, old.ready_at = SeqStatus.SUSPENDED, 100, 1, 5.0
    old._set_generated(5)
    new = Seq(Request(rid=1, arrival=5.0, prompt_len=100, tuf=TUF_NORMAL), clock, 1)
    dec = make_policy("timelyllm").schedule(_snap([new], [old], 5.0, max_num_seqs=1))
    assert dec.resume == [0]
    assert dec.prefill == []
    # With room for both, both go, the resumed segment first.
    dec = make_policy("timelyllm").schedule(_snap([new], [old], 5.0, max_num_seqs=2))
    assert dec.resume == [0]
    assert [r for r, _ in dec.prefill] == [1]


def test_urgent_new_request_goes_before_normal_one() -> None:
    clock = DecodeClock()
    normal = Seq(Request(rid=0, arrival=0.0, prompt_len=100, tuf=TUF_NORMAL), clock, 0)
    urgent = Seq(Request(rid=1, arrival=0.0, prompt_len=100, tuf=TUF_URGENT), clock, 1)
    dec = make_policy("timelyllm").schedule(_snap([normal, urgent], [], 0.0, max_num_seqs=1))
    assert [r for r, _ in dec.prefill] == [1]


def test_suspended_segment_not_yet_due_asks_for_wake_up() -> None:
    clock = DecodeClock()
    s = Seq(Request(rid=0, arrival=0.0, prompt_len=100, tuf=TUF_NORMAL), clock, 0)
    s.status, s.prefilled, s.segment_index, s.ready_at = SeqStatus.SUSPENDED, 100, 1, 10.0
    s._set_generated(5)
    dec = make_policy("timelyllm").schedule(_snap([], [s], 1.0, max_num_seqs=4))
    assert dec.resume == []
    assert dec.wake_at is not None
    assert 1.0 < dec.wake_at < 10.0


def test_latency_guard_counts_the_prefills_admitted_in_the_same_call() -> None:
    """§4.4: one urgent segment is decoding, 16 new tasks arrive at once. Whatever the
    policy admits lands in the urgent segment's next step (their prefill) and batch
    (their decoding): the segment must still end by its due time under the same cost
    model. A guard counting only resumed sequences would let all 16 in (late 0.6 s)."""
    cost, cfg = paper_rtx4090()
    clock = DecodeClock()
    now = 10.0
    urgent = Seq(Request(rid=0, arrival=now - 0.05, prompt_len=300, tuf=TUF_URGENT), clock, 0)
    urgent.status, urgent.prefilled = SeqStatus.RUNNING, 300
    urgent._start_decoding()
    urgent._set_generated(4)
    waiting = [
        Seq(Request(rid=i, arrival=now, prompt_len=p, tuf=TUF_NORMAL), clock, i)
        for i, p in enumerate([20, 350, 20, 350] * 4, start=1)
    ]
    snap = EngineSnapshot(
        now=now,
        waiting=waiting,
        running=[urgent],
        prefilling=[],
        suspended=[],
        kv_capacity=cfg.kv_capacity,
        kv_free=cfg.kv_capacity - urgent.kv_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_batch_tokens=cfg.max_batch_tokens,
        num_decoding=1,
        cost=cost,
    )
    policy = make_policy("timelyllm")
    dec = policy.schedule(snap)
    due_left = urgent.req.arrival + TUF_URGENT.ert - now
    remaining = policy.segment_tokens - 4  # type: ignore[attr-defined]
    kv = urgent.kv_tokens
    solo = remaining * cost.step_time(0, 0.0, 1, kv)
    assert solo < due_left  # on time alone, so the guard has something to protect
    tokens = sum(n for _, n in dec.prefill)
    attn = float(sum(n * n for _, n in dec.prefill))
    d_after = 1 + len(dec.prefill)
    wcet = cost.step_time(tokens, attn, 1, kv) + (remaining - 1) * cost.step_time(
        0, 0.0, d_after, kv
    )
    assert wcet <= due_left
    assert dec.prefill  # ... and it is a guard, not a stop: what fits still goes in
    assert len(dec.prefill) < len(waiting)


@pytest.mark.parametrize("kv_capacity", [None, 3000])
def test_simulated_run_resumes_without_reprefill_and_respects_memory(
    kv_capacity: int | None,
) -> None:
    jobs = lrtrace_jobs(2, seed=1, time_s=60.0)
    cost, cfg = paper_rtx4090()
    if kv_capacity is not None:
        cfg.kv_capacity = kv_capacity
    sim = Simulator(make_policy("timelyllm"), cost, cfg)
    res = sim.run(jobs)
    assert res.kv_peak <= cfg.kv_capacity
    for job, rec in zip(jobs, res.records, strict=True):
        assert rec.completed
        assert rec.output_tokens == rec.target_tokens == job.output_len
        assert len(rec.segment_done) == len(job.segments)
    if res.preemptions == 0:
        assert sim.prefill_tokens == sum(j.request.prompt_len for j in jobs)
    if kv_capacity is None:
        assert res.preemptions == 0


def test_vllm_stream_never_holds_a_generation() -> None:
    jobs = lrtrace_jobs(1, seed=0, time_s=40.0)
    cost, cfg = paper_rtx4090()
    sim = Simulator(make_policy("vllm-stream"), cost, cfg)
    res = sim.run(jobs)
    assert sim.prefill_tokens == sum(j.request.prompt_len for j in jobs)
    for job, rec in zip(jobs, res.records, strict=True):
        # Segments follow each other back to back: nothing waits for the robot.
        gaps = [b - a for a, b in zip(rec.segment_done, rec.segment_done[1:], strict=False)]
        assert all(g < min(job.segment_gaps) for g in gaps)


def test_robot_outcome_hand_case() -> None:
    req = Request(rid=0, arrival=0.0, prompt_len=10, tuf=TUF_NORMAL)
    job = Job(req, 10, (5, 5), (2.0,))
    # Segment 1 arrives before the robot finishes action 0 (at 2.5): no waiting.
    assert robot_outcome(job, [0.5, 1.0]) == pytest.approx((2.0, 0.5, 0.5))
    # Segment 1 arrives at 3.0, 0.5 s late: TUF1(0.5) = 0.
    assert robot_outcome(job, [0.5, 3.0]) == pytest.approx((1.0, 0.5, 1.0))


def test_overhead_microbenchmark_runs() -> None:
    oh = overhead((8,), repeats=2)
    assert set(oh) == {"schedule_ms_8"}
    assert math.isfinite(oh["schedule_ms_8"])


@pytest.mark.parametrize("n", [8, 512])
def test_overhead_times_a_call_that_admits_and_resumes(n: int) -> None:
    """The timed call must be the busy case the docs describe (rank everything, admit
    and resume), not one that runs out of memory and preempts (it did at 512)."""
    snap = overhead_snapshot(n)
    assert snap.kv_free >= 0
    assert all(s.ready_at <= snap.now for s in snap.suspended)
    dec = make_policy("timelyllm").schedule(snap)
    assert dec.prefill
    assert dec.resume
    assert not dec.preempt
    assert not dec.cancel


def test_vllm_stream_resumes_within_max_num_seqs_and_cancels_what_never_fits() -> None:
    clock = DecodeClock()

    def seq(rid: int, status: SeqStatus, prompt: int = 50) -> Seq:
        s = Seq(Request(rid=rid, arrival=0.0, prompt_len=prompt), clock, rid)
        s.status, s.prefilled = status, prompt
        s.ready_at = 99.0  # not ready: vllm-stream resumes at once anyway
        return s

    running = [seq(0, SeqStatus.RUNNING)]
    parked = [seq(1, SeqStatus.SUSPENDED), seq(2, SeqStatus.SUSPENDED)]
    snap = EngineSnapshot(
        now=1.0,
        waiting=[],
        running=running,
        prefilling=[],
        suspended=parked,
        kv_capacity=10_000,
        kv_free=10_000 - 150,
        max_num_seqs=2,
        max_batch_tokens=4096,
        num_decoding=1,
    )
    dec = make_policy("vllm-stream").schedule(snap)
    assert dec.resume == [1]  # the batch holds 2: one running + one resumed
    # A suspended sequence that cannot take one more token even alone is cancelled.
    huge = seq(3, SeqStatus.SUSPENDED, prompt=200)
    snap.suspended, snap.kv_capacity, snap.kv_free = [huge], huge.kv_tokens, 0
    snap.running, snap.num_decoding = [], 0
    dec = make_policy("vllm-stream").schedule(snap)
    assert dec.cancel == [3]
    assert dec.resume == []


@pytest.mark.parametrize("policy", ["timelyllm", "fcfs"])
def test_the_records_score_as_the_robot_does(policy: str) -> None:
    """The executor's record of when the client wanted each segment (what every
    metric reads) agrees with the robot's own scoring, which runs its actions in
    order: utility totals match to rounding."""
    from duetime.metrics.columns import Columns
    from duetime.metrics.utility import segment_outcomes

    jobs = lrtrace_jobs(2, seed=0, time_s=120.0)
    cost, cfg = paper_rtx4090()
    res = Simulator(make_policy(policy), cost, cfg).run(jobs)
    robot = sum(robot_outcome(j, r.segment_done)[0] for j, r in zip(jobs, res.records, strict=True))
    recorded = float(segment_outcomes(Columns.from_records(res.records), None).utility.sum())
    assert recorded == pytest.approx(robot, rel=1e-9)
