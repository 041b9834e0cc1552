"""Every registered policy drives the real engine executor, on a tiny random-weight model.

``test_sim_invariants_all_policies`` fuzzes each policy in the simulator and
``test_engine_fuzz`` fuzzes the engine under a chaos policy. Neither covers
what only the engine does to a real policy: answers that end early on an
end-of-sequence token, clients that abort mid-answer, KV evicted for real.
Here each policy of the registry (its own default predictor, a few options
drawn at random) serves requests carrying every client field, with EOS stops
and aborts. What must hold: the run ends and frees everything (cache, books,
spool), every request ends exactly once, no answer is longer than asked, and
a finished answer that lost no KV is the model's greedy answer to its prompt,
whatever the policy batched, chunked, preempted or resumed around it.

The executor runs on a tick clock (every reading 1 ms after the previous), so a
run is a deterministic function of its inputs and a failure replays exactly.
``DUETIME_FUZZ_EXAMPLES=N`` searches deeper than the default 6 per policy.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from duetime.core.request import Job, Request, TimeUtility
from duetime.core.sequence import SeqStatus
from duetime.engine.executor import StopRule
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import available_policies, make_policy
from duetime.predict.oracle import make_job_predictor
from tests.engine_checks import CheckedEngine, solo_answer
from tests.factories import (
    POLICY_OPTIONS,
    SIMPLE_COST,
    fresh_jobs,
    maybe_two_segments,
    record_evictions,
)

EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "6"))


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1))


class TickClock:
    """A clock that reads 1 ms later at every call: runs replay exactly."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t


@st.composite
def _job(draw: Any, rid: int) -> Job:
    arrival = draw(st.sampled_from([0.0, 0.0, 0.002, 0.01, 0.05]))
    p = draw(st.integers(1, 30))
    output = draw(st.integers(1, 12))
    deadline = arrival + draw(st.floats(0.001, 0.3)) if draw(st.booleans()) else None
    req = Request(
        rid=rid,
        arrival=arrival,
        prompt_len=p,
        prompt_token_ids=tuple(draw(st.lists(st.integers(0, 255), min_size=p, max_size=p))),
        max_tokens=draw(st.sampled_from([64, 64, 3, 1])),
        deadline=deadline,
        priority=draw(st.integers(0, 3)),
        tuf=TimeUtility(ert=draw(st.floats(0.005, 0.3))) if draw(st.booleans()) else None,
        overrun=draw(st.sampled_from([None, "kill", "skip-next"])),
        kv_eviction=draw(st.sampled_from([None, "off", "auto", 0.25])),
    )
    segments, gaps = maybe_two_segments(draw, output, st.sampled_from([0.0, 0.003, 0.02]))
    return Job(req, output, segments, gaps)


@st.composite
def scenarios(draw: Any, policy: str) -> dict[str, Any]:
    return {
        "jobs": [draw(_job(rid)) for rid in range(draw(st.integers(1, 10)))],
        "options": draw(POLICY_OPTIONS.get(policy, st.just({}))),
        "seed": draw(st.integers(0, 10_000)),
        "kv_capacity": draw(st.sampled_from([45, 45, 60, 90, 400])),
        "max_num_seqs": draw(st.sampled_from([1, 2, 8])),
        "max_batch_tokens": draw(st.sampled_from([7, 32, 2048])),
        "offload": draw(st.booleans()),
        "eos": draw(st.booleans()),
        "aborts": draw(st.booleans()),
    }


def _serve(
    model: Gemma3, policy: str, sc: dict[str, Any]
) -> tuple[Any, CheckedEngine, set[int], set[int], dict[int, int]]:
    """One run: (result, executor, rids that lost KV, rids aborted, min tokens before EOS)."""
    pol = make_policy(policy, **sc["options"])
    evicted = record_evictions(pol)
    jobs = fresh_jobs(sc["jobs"])
    ex = CheckedEngine(
        pol,
        model,
        kv_capacity=sc["kv_capacity"],
        max_num_seqs=sc["max_num_seqs"],
        max_batch_tokens=sc["max_batch_tokens"],
        predictor=make_job_predictor(getattr(pol, "default_predictor", None), seed=sc["seed"]),
        cost=SIMPLE_COST,
        clock=TickClock(),
        offload_suspended=sc["offload"],
        skip_idle=True,
    )
    r = random.Random(sc["seed"])
    min_tokens: dict[int, int] = {}
    if sc["eos"]:  # an id some answer really produces early, so that EOS stops happen
        firsts = [t for j in jobs for t in solo_answer(model, j.request.prompt_token_ids or (), 3)]
        ex.eos_token_id = r.choice(firsts)
        for j in jobs:
            if r.random() < 0.5:
                min_tokens[j.request.rid] = m = r.choice([0, 1, 2])
                ex.stop_tokens[j.request.rid] = StopRule(frozenset({ex.eos_token_id}), m)
    aborted: set[int] = set()
    if sc["aborts"]:

        def on_tokens(produced: list[tuple[int, int]]) -> None:
            if r.random() < 0.1:
                rid = r.randrange(len(jobs))
                seq = ex.seqs.get(rid)
                if seq is not None and seq.status < SeqStatus.FINISHED and ex.abort(rid):
                    aborted.add(rid)

        ex.on_tokens = on_tokens
    return ex.run(jobs, max_wall_s=60.0), ex, evicted, aborted, min_tokens


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_on_the_engine_frees_everything_and_keeps_greedy_answers(
    model: Gemma3, policy: str
) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        print_blob=True,
        derandomize=True,
        report_multiple_bugs=False,
    )
    @given(scenarios(policy))
    def check(sc: dict[str, Any]) -> None:
        note(f"{policy} {sc}")
        res, ex, evicted, aborted, min_tokens = _serve(model, policy, sc)
        note(f"counters={res.counters} evicted={evicted} aborted={aborted}")
        assert not ex.in_system, "the run did not end"
        assert not ex.kv.slots
        assert ex.kv.total_tokens == 0
        assert ex.kv_used == 0
        assert ex.spooled_at_close == {}
        assert ex._spool is None
        assert res.kv_peak <= sc["kv_capacity"]
        jobs = {j.request.rid: j for j in sc["jobs"]}
        assert sorted(rec.request.rid for rec in res.records) == sorted(jobs)
        for rec in res.records:
            rid = rec.request.rid
            job = jobs[rid]
            assert (rec.finish is None) != (rec.cancelled_at is None), rec
            assert rec.output_tokens <= min(job.output_len, job.request.max_tokens), rec
            if rec.finish is None:
                assert rid not in aborted or rec.cancelled_at is not None
                continue
            out = res.outputs[rid]
            assert len(out) == rec.output_tokens == rec.target_tokens, rec
            if rid in evicted:
                continue  # lost KV: its text may change, not its length
            expect = solo_answer(model, job.request.prompt_token_ids or (), len(out))
            if rid in min_tokens:  # it ends at its first allowed end-of-sequence
                stops = [k for k, t in enumerate(expect) if t == ex.eos_token_id]
                stops = [k for k in stops if k + 1 >= min_tokens[rid]]
                assert not stops or len(out) == stops[0] + 1, (rid, out, expect)
            assert out == expect, rid

    check()
