"""Forecasts: an executor's image, forked into the simulator, plays out as the original.

The strongest check there is: stop a simulation part-way, image it, fork a fresh
simulator from the image under the policy the image forked (its private state
carried on), hand it the true lengths and the requests still to come, and every
request must finish at exactly the time the uninterrupted simulation has it finish.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Mapping

import pytest

from duetime import workloads as wl
from duetime.core.executor import ExecutorError
from duetime.core.image import LiveSeq
from duetime.core.policy import Policy
from duetime.core.request import Job, Request
from duetime.core.sequence import SeqStatus
from duetime.policies.registry import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.sim.forecast import forecast
from duetime.sim.profiles import load_profile
from duetime.sim.simulator import SimConfig, Simulator
from duetime.workloads.lrtrace import lrtrace_jobs

COST, _ = load_profile()


def _synthetic() -> list[Job]:
    jobs = wl.build_jobs(
        300,
        source=wl.SyntheticSource((16, 1500), (16, 400)),
        arrivals=wl.Poisson(rate=25),
        seed=3,
    )
    for j in jobs:
        j.request.deadline = j.request.arrival + 6.0
    return jobs


def _fork_matches(
    policy: str, jobs: list[Job], config: SimConfig, cut: float, **kwargs: object
) -> Counter[str]:
    """Assert the fork at ``cut`` finishes every request as the whole run does; the
    states the image held."""
    whole = Simulator(make_policy(policy, **kwargs), COST, copy.deepcopy(config))
    truth = {r.request.rid: r.finish for r in whole.run(copy.deepcopy(jobs)).records}

    jobs = copy.deepcopy(jobs)
    cut_config = SimConfig(**{**_fields(config), "max_time": cut})
    first = Simulator(make_policy(policy, **kwargs), COST, cut_config)
    first.run(jobs)
    image = first.image()
    by_rid = {j.request.rid: j for j in jobs}
    later = [j for j in jobs if j.request.rid not in first.seqs]
    forked = image.fork_policy()
    assert forked is not None
    fc = forecast(image, forked, COST, job_of=lambda s: by_rid[s.request.rid], arrivals=later)
    assert image.now == first.now
    ended = first.records.items()  # finished or cancelled (TimeBill's kills) before the cut
    got = {
        rid: rec.finish
        for rid, rec in ended
        if rec.finish is not None or rec.cancelled_at is not None
    }
    assert not set(got) & {s.request.rid for s in image.seqs}
    got.update({rid: fc.finish[rid] for rid in fc.finish if rid not in got})
    assert got.keys() == truth.keys()
    for rid, end in truth.items():
        assert (got[rid] is None) == (end is None), rid
        if end is not None:
            assert got[rid] == pytest.approx(end, rel=1e-12, abs=1e-9), rid
    return Counter(_state(s) for s in image.seqs)


def _predicted(jobs: list[Job], predictor: str) -> list[Job]:
    """``jobs`` with a length prediction on every request, as a simulator's predictor
    would set it on arrival (a fork has no predictor: its arrivals must carry theirs)."""
    p = make_job_predictor(predictor)
    assert p is not None
    for j in jobs:
        j.request.predicted = p.predict_job(j)
    return jobs


def _state(s: LiveSeq) -> str:
    if s.status is SeqStatus.RUNNING and s.prefilled < s.prefill_target:
        return "RUNNING-prefilling"
    if s.status is SeqStatus.WAITING and s.generated:
        return "WAITING-preempted"
    return s.status.name


def _fields(config: SimConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ["fcfs", "edf", "sjf", "vllm-stream", "deferred-prefill"])
def test_a_fork_finishes_every_request_as_the_whole_run(policy: str) -> None:
    """Decoding, prefilling (chunked: prompts of up to 1,500 tokens in steps of 512) and
    waiting requests (KV for ~6 long ones), forked at three times."""
    config = SimConfig(kv_capacity=6_000, max_num_seqs=48, max_batch_tokens=512)
    seen: Counter[str] = Counter()
    for cut in (1.5, 4.0, 8.0):
        seen += _fork_matches(policy, _synthetic(), config, cut)
    assert seen["RUNNING"] > 0
    assert seen["WAITING"] > 0
    assert seen["WAITING-preempted"] > 0
    if policy in ("fcfs", "vllm-stream", "deferred-prefill"):  # (cut between two chunks)
        assert seen["RUNNING-prefilling"] > 0


# Policies that remember: Amin raises a cancelled request's bound; A_ℓ marks promoted
# requests long and queues by ticket; TimeBill evicts each request's KV once;
# deferred prefill with K > 1 counts departures since its last prefill phase.
STATEFUL = [
    ("amin", {}, "interval:rough"),
    ("aell", {}, "interval:rough"),
    ("timebill", {}, "oracle"),
    ("deferred-prefill", {"k": 8}, None),
]


@pytest.mark.parametrize(("policy", "kwargs", "predictor"), STATEFUL)
def test_a_fork_carries_the_policys_memory_on(
    policy: str, kwargs: dict[str, object], predictor: str | None
) -> None:
    """The image's fork of a stateful policy plays out as the whole run; a fresh
    instance, which forgets, does not (so the state is real and the check can fail)."""
    config = SimConfig(kv_capacity=6_000, max_num_seqs=48, max_batch_tokens=512)
    base = _synthetic() if predictor is None else _predicted(_synthetic(), predictor)
    for cut in (1.5, 4.0, 8.0):
        _fork_matches(policy, copy.deepcopy(base), config, cut, **kwargs)

    jobs = copy.deepcopy(base)
    cut_config = SimConfig(**{**_fields(config), "max_time": 4.0})
    first = Simulator(make_policy(policy, **kwargs), COST, cut_config)
    first.run(jobs)
    image = first.image()
    by_rid = {j.request.rid: j for j in jobs}
    later = [j for j in jobs if j.request.rid not in first.seqs]

    def play(p: Policy | None) -> Mapping[int, float | None]:
        assert p is not None
        fc = forecast(image, p, COST, job_of=lambda s: by_rid[s.request.rid], arrivals=later)
        return fc.finish

    assert play(make_policy(policy, **kwargs)) != play(image.fork_policy())


@pytest.mark.parametrize("policy", ["amin", "aell", "timebill", "deferred-prefill", "timelyllm"])
def test_a_fork_shares_no_state_with_its_policy(policy: str) -> None:
    """A forecast changes the policy it runs; the image's copy and the live policy
    must not notice, so two forecasts from one image agree."""
    jobs = _predicted(_synthetic(), "interval:rough")
    live = make_policy(policy, **({"k": 8} if policy == "deferred-prefill" else {}))
    first = Simulator(live, COST, SimConfig(kv_capacity=6_000, max_num_seqs=48, max_time=4.0))
    first.run(jobs)
    image = first.image()
    before = copy.deepcopy(vars(live))
    held = copy.deepcopy(vars(image.policy))
    by_rid = {j.request.rid: j for j in jobs}
    later = [j for j in jobs if j.request.rid not in first.seqs]
    runs = []
    for _ in range(2):
        forked = image.fork_policy()
        assert forked is not None
        arrivals = copy.deepcopy(later)
        fc = forecast(
            image, forked, COST, job_of=lambda s: by_rid[s.request.rid], arrivals=arrivals
        )
        runs.append(fc.finish)
        assert vars(forked) != held  # the forecast did change the policy it ran
    assert runs[0] == runs[1]
    assert vars(live) == before
    assert vars(image.policy) == held


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("policy", ["timelyllm", "edf"])
def test_a_fork_of_segmented_requests_resumes_them_as_the_whole_run(
    policy: str, offload: bool
) -> None:
    """Robot plans (TimelyLLM's LRTrace): requests suspended between segments, their KV
    on the device or offloaded (parked), and resumed when the robot wants the next."""
    config = SimConfig(
        kv_capacity=6000, max_num_seqs=32, max_batch_tokens=2048, offload_suspended=offload
    )
    seen: Counter[str] = Counter()
    for cut in (5.0, 20.0):
        seen += _fork_matches(policy, lrtrace_jobs(2, seed=0, time_s=60.0), config, cut)
    assert seen["SUSPENDED"] > 0


def test_a_fork_takes_a_length_it_is_told_within_what_the_answer_can_be() -> None:
    """A length shorter than the answer already is becomes one token more than it has;
    one past ``max_tokens`` becomes ``max_tokens``."""
    jobs = [
        Job(Request(rid=i, arrival=0.0, prompt_len=32, max_tokens=50), output_len=50)
        for i in range(2)
    ]
    sim = Simulator(make_policy("fcfs"), COST, SimConfig(max_time=0.2))
    sim.run(jobs)
    image = sim.image()
    made = {s.request.rid: s.generated for s in image.seqs}
    assert all(1 < g < 50 for g in made.values()), made
    told = {0: 1, 1: 10_000}
    fork = Simulator(make_policy("fcfs"), COST)
    fork.restore(image, lambda s: Job(s.request, output_len=told[s.request.rid]))
    assert fork.records[0].target_tokens == made[0] + 1
    assert fork.records[1].target_tokens == 50
    fork.run([])
    assert fork.records[0].output_tokens == made[0] + 1
    assert fork.records[1].output_tokens == 50


def test_restore_needs_an_executor_without_requests() -> None:
    job = Job(Request(rid=0, arrival=0.0, prompt_len=8, max_tokens=4), output_len=4)
    sim = Simulator(make_policy("fcfs"), COST)
    sim.admit_arrival(job)
    image = sim.image()
    assert [s.status for s in image.seqs] == [SeqStatus.WAITING]
    with pytest.raises(ExecutorError, match="no requests"):
        sim.restore(image, lambda s: job)


def test_a_forecast_stops_at_its_horizon_and_seeds_cached_prompts() -> None:
    """Past ``horizon`` nothing finishes; an arrival whose prompt the engine's cache
    holds computes only the rest (the fork's cache starts with those blocks)."""
    ids = tuple(range(1, 1025))
    long_one = Job(
        Request(rid=7, arrival=0.0, prompt_len=1024, max_tokens=4, prompt_token_ids=ids),
        output_len=4,
    )
    sim = Simulator(make_policy("fcfs"), COST, SimConfig(prefix_cache_tokens=4096))
    image = sim.image()
    assert image.seqs == ()
    assert image.prefix_cache_tokens == 4096

    def job_of(s: LiveSeq) -> Job:
        raise AssertionError("no request in the image")

    cold = forecast(image, make_policy("fcfs"), COST, job_of=job_of, arrivals=[long_one])
    warm = forecast(
        image, make_policy("fcfs"), COST, job_of=job_of, arrivals=[long_one], cached={7: 1008}
    )
    cold_end, warm_end = cold.finish[7], warm.finish[7]
    assert cold_end is not None
    assert warm_end is not None
    prefill_cold = COST.step_time(1024, 1024 * 1024 / 2, 0, 0)
    assert warm_end < cold_end - 0.5 * prefill_cold
    cut = forecast(
        image, make_policy("fcfs"), COST, job_of=job_of, arrivals=[long_one], horizon=1e-6
    )
    assert cut.finish[7] is None
    assert cut.misses([7], {7: 1.0}) == [7]
    assert cold.misses([7], {7: cold_end}) == []
    assert cold.misses([7], {}) == []
    assert math.isfinite(cold.sim_time)
    assert cold.engine_steps >= 4
