"""Policies charge a step's token budget only for what a prefill computes.

A waiting request whose prompt begins with cached blocks copies their KV and
computes the rest. The snapshot's ``prefix_hit`` tells the policy how much
that is before it decides, so a burst of requests behind a cached system
prompt goes in together instead of one whole prompt's worth per step; the
KV memory a policy reserves is still the whole prompt's (a hit is a copy).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from duetime.core.request import Job, Request
from duetime.core.sequence import SeqStatus
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.sim import SimConfig, Simulator
from tests.factories import SIMPLE_COST, fresh_jobs

PREFIX, PROMPT, BURST, BUDGET = 96, 100, 6, 64


def _burst(with_ids: bool) -> list[Job]:
    """One request that leaves a 96-token system prompt in the cache, then, once it is
    done, six at the same instant that begin with it."""
    shared = tuple(range(3, 3 + PREFIX))
    jobs = []
    for rid in range(1 + BURST):
        ids = shared + tuple(100 + 20 * rid + k for k in range(PROMPT - PREFIX))
        req = Request(
            rid=rid,
            arrival=0.0 if rid == 0 else 50.0,
            prompt_len=PROMPT,
            prompt_token_ids=ids if with_ids else None,
            prefix_group=None if with_ids else "sys",
            prefix_len=0 if with_ids else PREFIX,
        )
        jobs.append(Job(req, 3))
    return jobs


def _recording(policy: Any) -> list[list[tuple[int, int, int]]]:
    """Wrap ``policy.schedule``: per call, (rid, tokens asked, hit it was told) of each
    waiting request it admits."""
    calls: list[list[tuple[int, int, int]]] = []
    schedule = policy.schedule

    def spy(snap: Any) -> Any:
        dec = schedule(snap)
        waiting = {s.rid: s for s in snap.waiting}
        calls.append(
            [(rid, n, snap.prefix_hit(waiting[rid])) for rid, n in dec.prefill if rid in waiting]
        )
        return dec

    policy.schedule = spy
    return calls


def _admissions(calls: list[list[tuple[int, int, int]]]) -> list[list[int]]:
    return [[rid for rid, _, _ in c] for c in calls if c]


def _simulate(policy: str, jobs: list[Job], cache: int) -> tuple[Any, list[Any]]:
    pol = make_policy(policy)
    calls = _recording(pol)
    predictor = make_job_predictor(getattr(pol, "default_predictor", None), seed=0)
    cfg = SimConfig(
        kv_capacity=10_000, max_num_seqs=16, max_batch_tokens=BUDGET, prefix_cache_tokens=cache
    )
    sim = Simulator(pol, SIMPLE_COST, cfg, predictor)
    sim.run(fresh_jobs(jobs))
    return sim, calls


@pytest.mark.parametrize("policy", ["fcfs", "edf", "timelyllm", "amin", "deferred-prefill"])
def test_a_burst_behind_a_cached_prefix_is_admitted_in_one_step(policy: str) -> None:
    """Each of the six computes 4 tokens, so all fit one 64-token step; charged their
    whole 100-token prompts they took one (chunked) admission per step."""
    sim, calls = _simulate(policy, _burst(with_ids=False), cache=4096)
    burst = [c for c in calls if any(rid != 0 for rid, _, _ in c)]
    assert [sorted(rid for rid, _, _ in c) for c in burst] == [list(range(1, 1 + BURST))]
    assert all(hit == PREFIX and n <= PROMPT - hit for _, n, hit in burst[0])
    firsts = {sim.records[rid].first_token for rid in range(1, 1 + BURST)}
    assert len(firsts) == 1  # one prefill step, one first token for all
    for rid in range(1, 1 + BURST):
        assert sim.records[rid].cached_prompt_tokens == PREFIX


@pytest.mark.parametrize("policy", ["fcfs", "timelyllm", "amin", "deferred-prefill"])
def test_without_a_cache_the_burst_is_charged_whole_prompts(policy: str) -> None:
    """The control: no cache, no hit; no step takes more than 64 prompt tokens, so the
    six go in over several calls."""
    sim, calls = _simulate(policy, _burst(with_ids=False), cache=0)
    assert all(hit == 0 for c in calls for _, _, hit in c)
    assert len(_admissions(calls)) > 2
    assert len({sim.records[rid].first_token for rid in range(1, 1 + BURST)}) > 1


def test_the_hit_a_policy_is_told_is_the_one_the_executor_finds() -> None:
    """Over a random workload with two system prompts, a small cache (so blocks come and
    go) and preemptions, every admission's told hit equals the cached tokens the
    executor then gave it (a request admitted twice, after a recompute, keeps the
    last)."""
    r = random.Random(5)
    jobs = []
    for rid in range(60):
        prompt = r.randint(40, 160)
        group = r.choice(["a", "b", None])
        req = Request(
            rid=rid,
            arrival=r.uniform(0, 3),
            prompt_len=prompt,
            prefix_group=group,
            prefix_len=r.randint(30, prompt) if group else 0,
        )
        jobs.append(Job(req, r.randint(1, 60)))
    for policy in ("fcfs", "timelyllm", "amin", "deferred-prefill"):
        pol = make_policy(policy)
        calls = _recording(pol)
        predictor = make_job_predictor(getattr(pol, "default_predictor", None), seed=0)
        cfg = SimConfig(
            kv_capacity=1_500, max_num_seqs=8, max_batch_tokens=128, prefix_cache_tokens=256
        )
        sim = Simulator(pol, SIMPLE_COST, cfg, predictor)
        sim.run(fresh_jobs(jobs))
        # (a record counts the prompt's cached tokens; a recompute's hit may go on
        # into the answer it had)
        prompt = {j.request.rid: j.request.prompt_len for j in jobs}
        told = {rid: min(hit, prompt[rid]) for c in calls for rid, _, hit in c}
        assert len(told) == len(jobs), policy
        assert any(told.values()), policy
        got = {rid: rec.cached_prompt_tokens for rid, rec in sim.records.items()}
        assert told == got, policy


def test_the_engine_admits_the_burst_in_one_step_too() -> None:
    """The same rule on the real engine (tiny model), from its hashed prompt tokens."""
    engine = EngineExecutor(
        make_policy("fcfs"),
        engine_from_hf(tiny_hf_model(seed=3)),
        kv_capacity=10_000,
        max_num_seqs=16,
        max_batch_tokens=BUDGET,
        prefix_cache_tokens=4096,
        eviction="streaming",  # (SnapKV would leave its 32-token window to compute)
        skip_idle=True,
    )
    calls = _recording(engine.policy)
    res = engine.run(fresh_jobs(_burst(with_ids=True)))
    burst = [c for c in _admissions(calls) if 0 not in c]
    assert [sorted(c) for c in burst] == [list(range(1, 1 + BURST))]
    cached = {rec.request.rid: rec.cached_prompt_tokens for rec in res.records}
    assert cached == {0: 0} | dict.fromkeys(range(1, 1 + BURST), PREFIX)


def test_a_sequence_not_waiting_has_no_hit() -> None:
    """Running sequences' prefills carry on where they stand: the lookup is for
    admissions only."""
    sim, _ = _simulate("fcfs", _burst(with_ids=False), cache=4096)
    snap = sim.snapshot()
    assert snap.prefix_lookup is not None
    done = sim.seqs[1]
    assert done.status is SeqStatus.FINISHED
    assert snap.prefix_hit(done) == 0
