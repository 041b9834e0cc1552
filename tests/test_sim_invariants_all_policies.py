"""Simulator invariants for every registered policy on random small workloads.

``test_sim_properties`` fuzzes the queue policies and a chaos policy; this file
runs each policy of the registry (with its own default predictor and a few of
its options drawn at random) over requests that carry every optional field a
client can set: deadlines, priorities, time-utility functions, max_tokens,
segments, overrun strategies, KV-eviction ratios and shared prompt beginnings
(with and without a prefix cache, whose hits the policies charge no step
budget for: the executor refuses a step over it). What must hold for any
policy: the run ends, every request ends exactly once, memory stays within
capacity, nobody gets more tokens than asked for, times are ordered, and the
same seed gives the same run. ``DUETIME_FUZZ_EXAMPLES=500`` searches deeper
than the default 25 examples per policy that CI runs.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from duetime.core.request import Job, Request, TimeUtility
from duetime.policies import available_policies, make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.sim import SimConfig, Simulator
from tests.factories import POLICY_OPTIONS, SIMPLE_COST, fresh_jobs, maybe_two_segments

MAX_POLICY_CALLS = 20_000
EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "25"))


@st.composite
def _job(draw: Any, rid: int, t: float) -> Job:
    prompt = draw(st.integers(1, 150))
    output = draw(st.integers(1, 90))
    # a third begin with one of two shared system prompts (the prefix cache's hits)
    group = draw(st.sampled_from([None, None, None, "a", "b"])) if prompt > 1 else None
    prefix = draw(st.integers(2, prompt)) if group else 0
    deadline = t + draw(st.floats(0.05, 5.0)) if draw(st.booleans()) else None
    tuf = TimeUtility(ert=draw(st.floats(0.05, 3.0))) if draw(st.booleans()) else None
    request = Request(
        rid=rid,
        arrival=t,
        prompt_len=prompt,
        max_tokens=draw(st.sampled_from([4096, draw(st.integers(1, 90))])),
        deadline=deadline,
        priority=draw(st.integers(0, 3)),
        tuf=tuf,
        overrun=draw(st.sampled_from([None, "kill", "skip-next"])),
        kv_eviction=draw(st.sampled_from([None, "off", "auto", 0.25])),
        prefix_group=group,
        prefix_len=prefix,
    )
    segments, gaps = maybe_two_segments(draw, output, st.floats(0.0, 0.3))
    return Job(request, output, segments, gaps)


@st.composite
def scenarios(draw: Any, policy: str) -> tuple[list[Job], SimConfig, dict[str, Any], int]:
    jobs = []
    t = 0.0
    for rid in range(draw(st.integers(1, 20))):
        t += draw(st.floats(0.0, 0.4))
        jobs.append(draw(_job(rid, t)))
    cfg = SimConfig(
        kv_capacity=draw(st.integers(100, 2500)),
        max_num_seqs=draw(st.integers(1, 12)),
        max_batch_tokens=draw(st.sampled_from([16, 64, 4096])),
        offload_suspended=draw(st.booleans()),
        prefix_cache_tokens=draw(st.sampled_from([0, 0, 64, 4096])),
    )
    options = draw(POLICY_OPTIONS.get(policy, st.just({})))
    return jobs, cfg, options, draw(st.integers(0, 10_000))


def _run(policy: str, jobs: list[Job], cfg: SimConfig, options: dict[str, Any], seed: int) -> Any:
    """A fresh policy, predictor and copy of the jobs (predictors fill ``Request.predicted``)."""
    fresh = fresh_jobs(jobs)
    pol = make_policy(policy, **options)
    predictor = make_job_predictor(getattr(pol, "default_predictor", None), seed=seed)
    sim = Simulator(pol, SIMPLE_COST, cfg, predictor)
    schedule = pol.schedule

    def bounded(snap: Any) -> Any:
        # ~20 requests of <= 90 tokens need a few thousand calls; far more is a livelock
        if sim.policy_calls > MAX_POLICY_CALLS:
            raise AssertionError(f"{policy}: no end after {MAX_POLICY_CALLS} policy calls")
        return schedule(snap)

    pol.schedule = bounded  # type: ignore[method-assign]
    return sim.run(fresh)


def _outline(res: Any) -> list[tuple[Any, ...]]:
    return [
        (r.first_token, r.finish, r.cancelled_at, r.output_tokens, r.num_preemptions)
        for r in res.records
    ]


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_keeps_the_invariants(policy: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
        derandomize=True,
        report_multiple_bugs=False,
    )
    @given(scenarios(policy))
    def check(scenario: tuple[list[Job], SimConfig, dict[str, Any], int]) -> None:
        jobs, cfg, options, seed = scenario
        note(f"{policy} {options} seed={seed} {cfg}\n" + "\n".join(map(repr, jobs)))
        res = _run(policy, jobs, cfg, options, seed)
        assert res.kv_peak <= cfg.kv_capacity
        assert sorted(r.request.rid for r in res.records) == [j.request.rid for j in jobs]
        truth = {j.request.rid: j for j in jobs}
        for rec in res.records:
            job = truth[rec.request.rid]
            arrival = job.request.arrival
            # ends exactly once
            assert (rec.finish is None) != (rec.cancelled_at is None), rec
            # never more than asked for, nor more than the answer has
            assert rec.output_tokens <= min(job.output_len, job.request.max_tokens), rec
            if rec.finish is not None:
                assert rec.output_tokens == rec.target_tokens, rec
                assert rec.output_tokens >= 1, rec
                assert rec.first_token is not None
                assert arrival <= rec.first_token <= rec.finish, rec
            else:
                assert rec.cancelled_at is not None
                assert rec.cancelled_at >= arrival, rec
                if rec.first_token is not None:
                    assert arrival <= rec.first_token <= rec.cancelled_at, rec
            assert len(rec.segment_done) <= max(len(job.segments), 1), rec
            assert all(
                ready >= done
                for done, ready in zip(rec.segment_done, rec.segment_ready, strict=False)
            )
        # every token produced is in some answer, unless a restart threw it away
        kept = sum(r.output_tokens for r in res.records)
        if res.counters.get("restarts", 0):
            assert res.tokens_generated >= kept
        else:
            assert res.tokens_generated == kept
        assert _outline(_run(policy, jobs, cfg, options, seed)) == _outline(res)

    check()


# --- the cases the fuzzing above found, kept as plain regressions ------------------


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("fcfs", {"chunked_prefill": False}),
        ("amin", {}),
        ("aell", {}),
        ("deferred-prefill", {}),
    ],
)
def test_a_prompt_longer_than_the_step_budget_ends(policy: str, options: dict[str, Any]) -> None:
    """No step takes 17 prompt tokens whole; without chunking it waited forever (and
    deferred-prefill, prefilling whole prompts, cancelled it: a served request aborted)."""
    jobs = [Job(Request(rid=0, arrival=0.0, prompt_len=17), 1)]
    res = _run(policy, jobs, SimConfig(kv_capacity=100, max_batch_tokens=16), options, 0)
    (rec,) = res.records
    assert rec.finish is not None
    assert rec.output_tokens == 1


@pytest.mark.parametrize("policy", ["amin", "amax", "aell", "hsf", "deferred-prefill"])
def test_a_segmented_request_resumes_after_its_gap(policy: str) -> None:
    """The Amin family and deferred-prefill never resumed a request between segments."""
    jobs = [Job(Request(rid=0, arrival=0.0, prompt_len=5), 6, (2, 4), (0.25,))]
    res = _run(policy, jobs, SimConfig(kv_capacity=100), {}, 0)
    (rec,) = res.records
    assert rec.finish is not None
    assert rec.output_tokens == 6
    assert rec.segment_ready
    assert rec.finish > rec.segment_ready[0]


@pytest.mark.parametrize("policy", ["amin", "amax", "aell"])
def test_suspended_requests_holding_all_memory_do_not_deadlock(policy: str) -> None:
    """Two requests between segments held the whole KV; neither could resume."""
    jobs = [Job(Request(rid=i, arrival=0.0, prompt_len=1), 1) for i in range(6)]
    jobs.append(Job(Request(rid=6, arrival=0.0, prompt_len=49), 2, (1, 1), (0.0,)))
    jobs.append(Job(Request(rid=7, arrival=0.0, prompt_len=39), 14, (13, 1), (0.25,)))
    cfg = SimConfig(kv_capacity=100, max_num_seqs=1, max_batch_tokens=16)
    res = _run(policy, jobs, cfg, {}, 0)
    assert [r.output_tokens for r in res.records] == [1] * 6 + [2, 14]
    assert all(r.finish is not None for r in res.records)


@pytest.mark.parametrize("policy", ["fcfs", "hsf"])
def test_restart_mode_waits_for_a_parked_segment_instead_of_livelocking(policy: str) -> None:
    """Restarting a request parked between segments sent it back first in the queue to
    redo its segment and park again, forever; now the queue waits for its gap."""
    jobs = [
        Job(Request(rid=0, arrival=0.0, prompt_len=27), 11, (2, 9), (0.5,)),
        Job(Request(rid=1, arrival=0.0, prompt_len=33), 3),
    ]
    options: dict[str, Any] = {"preempt_mode": "restart"} if policy == "fcfs" else {}
    res = _run(policy, jobs, SimConfig(kv_capacity=60), options, 0)
    assert [r.output_tokens for r in res.records] == [11, 3]
    assert all(r.finish is not None for r in res.records)
    assert res.counters.get("restarts", 0) == 0


@pytest.mark.parametrize(
    ("stall", "offload", "prompts", "kv"),
    [
        (True, True, (52, 48), 100),  # a stalled batch paged out meanwhile came back whole
        (False, False, (135, 40), 176),  # decoders grew under a prompt prefilled in pieces
    ],
)
def test_deferred_prefill_never_overcommits_the_next_step(
    stall: bool, offload: bool, prompts: tuple[int, int], kv: int
) -> None:
    """Both asked the engine for 2 KV tokens more than it has (a PolicyError)."""
    jobs = [
        Job(Request(rid=0, arrival=0.0, prompt_len=prompts[0]), 4, (1, 3), (0.06,)),
        Job(Request(rid=1, arrival=0.0, prompt_len=prompts[1]), 2),
        Job(Request(rid=2, arrival=0.0, prompt_len=1), 1),
    ]
    cfg = SimConfig(kv_capacity=kv, max_num_seqs=2, max_batch_tokens=16, offload_suspended=offload)
    res = _run("deferred-prefill", jobs, cfg, {"k": 1, "stall_decode": stall}, 0)
    assert res.kv_peak <= kv
    assert [r.output_tokens for r in res.records] == [4, 2, 1]


def test_timebill_does_not_resume_a_request_it_kills() -> None:
    """A segmented request whose deadline passed while its gap ran out was both killed
    and resumed in one decision: a PolicyError ("resume of CANCELLED request 7")."""
    one = [
        Job(Request(rid=i, arrival=0.0, prompt_len=1), n)
        for i, n in enumerate((1, 1, 1, 1, 38, 43))
    ]
    later = [
        Job(Request(rid=6, arrival=0.19140625, prompt_len=1), 10),
        Job(
            Request(rid=7, arrival=0.1953125, prompt_len=123, deadline=0.4609375),
            12,
            (11, 1),
            (0.1015625,),
        ),
        *(Job(Request(rid=i, arrival=0.1953125, prompt_len=1), 1) for i in (8, 9, 10)),
        Job(Request(rid=11, arrival=0.1953125, prompt_len=7), 20),
    ]
    cfg = SimConfig(kv_capacity=228, max_num_seqs=8, max_batch_tokens=64)
    options = {"overrun": "kill", "fixed_alpha": 0.0, "batch_aware": False}
    res = _run("timebill", one + later, cfg, options, 0)
    killed = res.records[7]
    assert killed.finish is None
    assert 0 < killed.output_tokens < 12
    assert all(r.finish is not None for i, r in enumerate(res.records) if i != 7)
