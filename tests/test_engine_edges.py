"""The engine executor at its edges, on a tiny random-weight model.

Greedy answers that do not depend on what runs around them (alone, batched,
chunked, preempted; any chunk size), the edges (exact fits, one-token answers and
prompts, limits of 1), decisions a policy must not make (each a PolicyError naming
the request), and one regression test per bug the engine's fuzz test
(``test_engine_fuzz.py``) found.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest
import torch

from duetime.core.decision import Decision
from duetime.core.executor import ExecutorError
from duetime.core.policy import PolicyError
from duetime.core.request import Job, Request
from duetime.core.sequence import SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import SeqChunk, greedy_generate
from duetime.engine.eviction import snapkv_evict, streaming_llm_evict
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, hf_greedy, tiny_hf_model
from duetime.policies import make_policy
from duetime.policies.base import QueuePolicy
from duetime.sim import SimConfig, Simulator
from tests.engine_checks import CheckedEngine, engine_job, random_prompt, solo_answer
from tests.factories import SIMPLE_COST


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=1)  # sliding window 4: shorter than most prompts below


@pytest.fixture(scope="module")
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf)


# --- greedy answers do not depend on what runs around them ----------------------


def test_alone_batched_chunked_and_preempted_answers_equal_transformers(
    hf: Any, model: Gemma3
) -> None:
    r = random.Random(3)
    jobs = [engine_job(i, random_prompt(r, r.randint(1, 30)), r.randint(1, 12)) for i in range(8)]
    ref = {
        j.request.rid: hf_greedy(hf, j.request.prompt_token_ids or (), j.output_len) for j in jobs
    }
    for kw in (
        {"max_num_seqs": 1},  # alone, one-shot prefill
        {"max_batch_tokens": 2048},  # all batched
        {"max_batch_tokens": 3},  # chunked prefill, 3 tokens a step
        {"max_batch_tokens": 1, "max_num_seqs": 1},  # one token per step, one sequence
        {"kv_capacity": 60, "max_batch_tokens": 16},  # preempted and recomputed
    ):
        for mode in ("recompute", "swap", "restart"):
            ex = CheckedEngine(make_policy("fcfs", preempt_mode=mode), model, **kw)
            res = ex.run(jobs)
            assert res.outputs == ref, (kw, mode)
            assert ex.kv.total_tokens == 0
            assert not ex.kv.slots
            if "kv_capacity" in kw:
                assert res.preemptions > 0


def test_chunk_sizes_do_not_change_the_answer(model: Gemma3) -> None:
    prompt = random_prompt(random.Random(4), 37)
    one_shot = greedy_generate(model, [list(prompt)], 10)[0]
    for chunk in (1, 2, 3, 5, 8, 36):
        assert greedy_generate(model, [list(prompt)], 10, chunk_size=chunk)[0] == one_shot


# --- edges ---------------------------------------------------------------------------


def test_an_answer_that_exactly_fills_the_kv_needs_no_preemption(model: Gemma3) -> None:
    prompt = random_prompt(random.Random(5), 20)
    # the last token is produced, never fed back: prompt + output - 1 KV tokens
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=20 + 12 - 1)
    res = ex.run([engine_job(0, prompt, 12)])
    assert res.outputs[0] == solo_answer(model, prompt, 12)
    assert res.preemptions == 0
    assert res.kv_peak == 31
    assert ex.kv.total_tokens == 0


def test_an_answer_one_token_too_long_for_the_kv_is_cancelled_cleanly(model: Gemma3) -> None:
    prompt = random_prompt(random.Random(5), 20)
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=20 + 12 - 2)
    res = ex.run([engine_job(0, prompt, 12)])
    rec = res.records[0]
    assert rec.cancelled_at is not None
    assert rec.finish is None
    assert res.outputs[0] == solo_answer(model, prompt, 12)[:11]  # what it had was right
    assert not ex.kv.slots
    assert ex.kv.total_tokens == 0


def test_a_prompt_that_can_never_fit_is_rejected_and_holds_nothing(model: Gemma3) -> None:
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=10)
    res = ex.run([engine_job(0, tuple(range(10)), 1), engine_job(1, tuple(range(9)), 1)])
    assert res.records[0].cancelled_at is not None
    assert res.counters["rejected"] == 1
    assert res.outputs[1] == solo_answer(model, tuple(range(9)), 1)  # prompt + 1 = capacity fits
    assert not ex.kv.slots


def test_many_tiny_requests_at_limits_of_one(model: Gemma3) -> None:
    r = random.Random(6)
    jobs = [
        engine_job(i, random_prompt(r, 1), r.choice([1, 2]), max_tokens=r.choice([1, 64]))
        for i in range(40)
    ]
    for kw in ({"max_num_seqs": 1}, {"max_batch_tokens": 1}, {"kv_capacity": 2}, {}):
        ex = CheckedEngine(make_policy("fcfs"), model, **kw)
        res = ex.run(jobs)
        for j in jobs:
            n = min(j.output_len, j.request.max_tokens)
            assert res.outputs[j.request.rid] == solo_answer(
                model, j.request.prompt_token_ids or (), n
            )
        assert all(rec.finish is not None for rec in res.records)
        assert not ex.kv.slots


# --- decisions a policy must not make: clear errors naming the request ----------------


class _Inject(QueuePolicy):
    """FCFS that, once request 0 is in ``when`` state, adds ``bad`` to one decision."""

    name = "inject"

    def __init__(self, when: str, bad: Any) -> None:
        super().__init__()
        self.when, self.bad, self.done = when, bad, False

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        seqs = {s.rid: s for g in (snap.running, snap.suspended, snap.waiting) for s in g}
        s0 = seqs.get(0)
        state = (
            "finished" if s0 is None
            else "prefilling" if not s0.prefill_done and s0.status is SeqStatus.RUNNING
            else "decoding" if s0.status is SeqStatus.RUNNING
            else s0.status.name.lower()
        )  # fmt: skip
        if state == self.when and not self.done:
            self.done = True
            self.bad(dec)
        return dec


@pytest.mark.parametrize(
    ("when", "bad", "message"),
    [
        ("finished", lambda d: d.cancel.append(0), "cancel of FINISHED request 0"),
        ("decoding", lambda d: d.cancel.append(7), "cancel of unknown request 7"),
        ("decoding", lambda d: d.resume.append(0), "resume of RUNNING request 0"),
        ("decoding", lambda d: d.resume.append(1), "resume of WAITING request 1"),
        ("finished", lambda d: d.resume.append(0), "resume of FINISHED request 0"),
        ("decoding", lambda d: d.evict.update({0: 1.0}), "ratio 1.0 not in"),
        ("decoding", lambda d: d.evict.update({0: float("nan")}), "ratio nan not in"),
        ("decoding", lambda d: d.evict.update({0: -0.1}), "ratio -0.1 not in"),
        ("decoding", lambda d: d.evict.update({1: 0.5}), "evict on request 1 without"),
        ("prefilling", lambda d: d.evict.update({0: 0.5}), "evict on request 0 without"),
        ("prefilling", lambda d: d.suspend.append(0), "suspend of non-decoding request 0"),
        ("decoding", lambda d: d.preempt.append(1), "preempt of WAITING request 1"),
        ("finished", lambda d: d.preempt.append(0), "preempt of FINISHED request 0"),
        ("decoding", lambda d: d.prefill.append((0, 0)), "prefill of request 0"),
        ("finished", lambda d: d.prefill.append((0, 0)), "prefill of request 0"),
    ],
)
def test_an_illegal_decision_is_a_policy_error_naming_the_request(
    model: Gemma3, when: str, bad: Any, message: str
) -> None:
    # one sequence at a time: request 1 waits while request 0 runs, then runs alone
    jobs = [engine_job(0, tuple(range(1, 9)), 4), engine_job(1, tuple(range(1, 30)), 20)]
    ex = EngineExecutor(
        _Inject(when, bad),
        model,
        max_num_seqs=1,
        max_batch_tokens=3 if when == "prefilling" else 64,
    )
    with pytest.raises(PolicyError, match=re.escape(message)):
        ex.run(jobs)


def test_abort_of_a_finished_or_unknown_request_is_harmless(model: Gemma3) -> None:
    ex = CheckedEngine(make_policy("fcfs"), model)
    prompt = tuple(range(3, 13))
    res = ex.run([engine_job(0, prompt, 3)])
    assert not ex.abort(0)
    assert not ex.abort(99)
    assert not ex.end_segment(0)
    assert not ex.finish_early(99)
    assert res.records[0].finish is not None
    assert res.outputs[0] == solo_answer(model, prompt, 3)


# --- regressions ----------------------------------------------------------------------


def test_a_duplicate_request_id_leaves_the_live_request_untouched(model: Gemma3) -> None:
    """Was: the engine stored the newcomer's prompt under the live request's id before the
    core refused the duplicate, so the live request went on from the wrong tokens."""
    prompt = tuple(range(10, 30))
    ex = CheckedEngine(make_policy("fcfs"), model)
    ex.start_clock()
    ex.admit_arrival(engine_job(0, prompt, 8))
    ex.tick()
    ex.tick()
    with pytest.raises(ExecutorError, match="duplicate request id 0"):
        ex.admit_arrival(engine_job(0, (1, 2, 3), 8))
    while ex.in_system:
        ex.tick()
    assert ex.tokens[0] == [*prompt, *solo_answer(model, prompt, 8)]
    assert ex.records[0].finish is not None


class _PrefillTwice(QueuePolicy):
    name = "prefill-twice"

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        dec.prefill = [(rid, 2) for rid, _ in dec.prefill] * 2
        return dec


def test_prefill_named_twice_in_one_decision_is_a_policy_error(model: Gemma3) -> None:
    """Was: an AssertionError deep in the model (a slot twice in one step) on the engine
    and a KeyError in the simulator, after the books had counted the chunk twice."""
    job = engine_job(0, tuple(range(1, 21)), 4)
    with pytest.raises(PolicyError, match="prefill of request 0 twice"):
        EngineExecutor(_PrefillTwice(), model).run([job])
    with pytest.raises(PolicyError, match="prefill of request 0 twice"):
        Simulator(_PrefillTwice(), SIMPLE_COST).run([Job(Request(0, 0.0, 20), 4)])


def test_streaming_after_snapkv_drops_exactly_n_in_every_global_layer(model: Gemma3) -> None:
    """Was: the StreamingLLM fallback (an eviction after SnapKV's) chose positions on one
    head of one global layer; the other global layers, holding other positions after
    SnapKV, kept fewer (7 instead of 11 here) and the count hid it (it is a max)."""
    cfg = model.config
    kv = model.new_kv_cache()
    slot = kv.allocate()
    kv.watch(slot, 8)
    model.step([SeqChunk(slot, list(random_prompt(random.Random(0), 40)), 0)], kv)
    snapkv_evict(kv, slot, 20, window=8)
    kv.unwatch(slot)
    model.step([SeqChunk(slot, [5], kv.seq_len(slot))], kv)  # one decode: 21 kept
    before = {i: kv.positions(slot, i).clone() for i in range(cfg.num_layers)}
    streaming_llm_evict(kv, slot, 10, sinks=4)
    assert kv.num_tokens(slot) == 11
    for i, sliding in enumerate(cfg.sliding_layers):
        pos = kv.positions(slot, i)
        if sliding:
            assert pos.shape[1] <= 11
            continue
        # each head keeps its own 4 oldest and 7 newest entries
        old = before[i]
        assert torch.equal(pos, torch.cat([old[:, :4], old[:, -7:]], dim=1)), i


def test_resumes_stay_within_the_step_token_budget() -> None:
    """Was: QueuePolicy resumed suspended sequences without counting them against
    max_batch_tokens, so with fewer step tokens than sequences FCFS made an illegal step
    (a PolicyError on the simulator, a failed step on the server)."""
    jobs = [
        Job(Request(rid=0, arrival=0.0, prompt_len=1), 30),
        Job(Request(rid=1, arrival=0.0, prompt_len=1), 6, (1, 5), (0.05,)),
        Job(Request(rid=2, arrival=0.0, prompt_len=1), 30),
    ]
    cfg = SimConfig(max_num_seqs=3, max_batch_tokens=2)
    for name in ("fcfs", "edf"):
        res = Simulator(make_policy(name), SIMPLE_COST, cfg).run(jobs)
        assert [rec.output_tokens for rec in res.records] == [30, 6, 30]


def test_resumes_stay_within_the_step_token_budget_on_the_engine(model: Gemma3) -> None:
    r = random.Random(7)
    jobs = [
        engine_job(0, random_prompt(r, 1), 30),
        engine_job(1, random_prompt(r, 1), 6, segments=(1, 5), gaps=(0.05,)),
        engine_job(2, random_prompt(r, 1), 30),
    ]
    ticks = itertools.count()
    ex = CheckedEngine(
        make_policy("fcfs"), model, max_num_seqs=3, max_batch_tokens=2,
        clock=lambda: next(ticks) * 0.001,  # request 2 takes the gap's place, then 1 is due
    )  # fmt: skip
    res = ex.run(jobs)
    for j in jobs:
        want = solo_answer(model, j.request.prompt_token_ids or (), j.output_len)
        assert res.outputs[j.request.rid] == want
