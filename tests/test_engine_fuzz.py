"""The engine executor under an erratic policy and at its edges, on a tiny random-weight model.

The property test does to the *engine* what ``test_sim_properties`` does to
the simulator: FCFS plus random cancels, suspends, resumes, evictions and
preemptions (every mode), client aborts, end-of-sequence stops, text segment
stops and trace segments, with tight memory and step limits down to one. After
every step each sequence's KV in the cache must equal the executor's books;
after the run the cache, the spool and the observation windows are empty, and
every finished answer that was never evicted is token for token the answer
the request gets alone (greedy, fp32), whatever was batched, chunked,
preempted, swapped or restarted around it.

Below it: the edges (exact fits, one-token answers and prompts, limits of 1),
decisions a policy must not make (each a PolicyError naming the request), and
one regression test per bug this pass found.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from duetime.core.decision import Decision
from duetime.core.executor import ExecutorError
from duetime.core.policy import PolicyError
from duetime.core.request import Job, Request
from duetime.core.sequence import SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import SeqChunk, greedy_generate
from duetime.engine.eviction import snapkv_evict, streaming_llm_evict
from duetime.engine.executor import EngineExecutor, StopRule
from duetime.engine.gemma3 import Gemma3
from duetime.engine.segment_stop import SegmentRule, TextSegmenter
from duetime.engine.testing import engine_from_hf, hf_greedy, tiny_hf_model
from duetime.policies import make_policy
from duetime.policies.base import QueuePolicy
from duetime.sim import SimConfig, Simulator
from tests.engine_checks import CheckedEngine, EngineChaos, solo_answer
from tests.factories import SIMPLE_COST


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=1)  # sliding window 4: shorter than most prompts below


@pytest.fixture(scope="module")
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf)


def _job(rid: int, prompt: tuple[int, ...], output: int, **kw: Any) -> Job:
    segs = kw.pop("segments", ())
    gaps = kw.pop("gaps", ())
    arrival = kw.pop("arrival", 0.0)
    req = Request(rid=rid, arrival=arrival, prompt_len=len(prompt), prompt_token_ids=prompt, **kw)
    return Job(req, output, segs, gaps)


def _prompt(r: random.Random, n: int) -> tuple[int, ...]:
    return tuple(r.randrange(256) for _ in range(n))


_BAR = SegmentRule("bar", re.compile(r"\|"))


def _bar_text(ids: Any) -> str:
    return "".join("|" if i % 5 == 0 else "a" for i in ids)


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    mode = draw(st.sampled_from(["recompute", "swap", "restart"]))
    segmented = draw(st.booleans())
    # A beginning some prompts share (whole 16-token blocks of it: prefix cache hits)
    shared = tuple(draw(st.lists(st.integers(0, 255), min_size=16, max_size=60)))
    jobs = []
    for i in range(draw(st.integers(1, 10))):
        p = draw(st.integers(1, 40))
        o = draw(st.integers(1, 16))
        segs: tuple[int, ...] = ()
        if segmented and o >= 2 and draw(st.booleans()):
            cut = draw(st.integers(1, o - 1))
            segs = (cut, o - cut)
        prompt = tuple(draw(st.lists(st.integers(0, 255), min_size=p, max_size=p)))
        if draw(st.booleans()):
            prompt = shared + prompt
        jobs.append(
            _job(
                i, prompt, o, segments=segs, gaps=(0.001,) if segs else (),
                max_tokens=draw(st.sampled_from([64, 64, 3])),
                arrival=draw(st.sampled_from([0.0, 0.0, 0.003, 0.02])),
            )
        )  # fmt: skip
    return {
        "jobs": jobs,
        "mode": mode,
        "p": draw(st.sampled_from([0.0, 0.05, 0.2])),
        "seed": draw(st.integers(0, 10_000)),
        "kv_capacity": draw(st.sampled_from([45, 60, 120, 400, 10_000])),
        "max_num_seqs": draw(st.sampled_from([1, 2, 8])),
        "max_batch_tokens": draw(st.sampled_from([1, 7, 32, 2048])),
        "eviction": draw(st.sampled_from(["snapkv", "streaming"])),
        "snapkv_window": draw(st.sampled_from([1, 4, 32])),
        "offload": draw(st.booleans()),
        "eos": draw(st.booleans()),
        "text_segments": segmented and draw(st.booleans()),
        "aborts": draw(st.booleans()),
        "prefix_cache": draw(st.sampled_from([0, 32, 4096])),
    }


@st.composite
def bursts(draw: Any) -> dict[str, Any]:
    """A chaos scenario whose requests arrive together and start alike (copies of one
    prompt, as ``n`` > 1 choices; prompts behind one beginning), with room to admit
    several in one step: their prefills share rows, then the chaos begins."""
    sc = draw(scenarios())
    first = tuple(draw(st.lists(st.integers(0, 255), min_size=17, max_size=50)))
    jobs = []
    for i in range(draw(st.integers(2, 8))):
        tail = tuple(draw(st.lists(st.integers(0, 255), max_size=20)))
        prompt = first if draw(st.booleans()) else first[: draw(st.integers(16, len(first)))] + tail
        o = draw(st.integers(1, 12))
        jobs.append(_job(i, prompt, o, max_tokens=64))
    sc.update(
        jobs=jobs,
        text_segments=False,
        kv_capacity=draw(st.sampled_from([200, 400, 10_000])),
        max_num_seqs=draw(st.sampled_from([4, 8])),
        max_batch_tokens=draw(st.sampled_from([40, 96, 2048])),
    )
    return sc


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
@given(scenarios())
def test_engine_under_chaos_frees_everything_and_keeps_greedy_answers(
    model: Gemma3, sc: dict[str, Any]
) -> None:
    _chaos(model, sc)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
@given(bursts())
def test_shared_prefills_under_chaos_keep_the_books_and_the_answers(
    model: Gemma3, sc: dict[str, Any]
) -> None:
    _chaos(model, sc)


def _chaos(model: Gemma3, sc: dict[str, Any]) -> None:
    """Run ``sc`` under :class:`EngineChaos` (the KV checked against the books after
    every step) and check that everything is freed and every answer not evicted is
    the request's answer alone."""
    jobs: list[Job] = sc["jobs"]
    policy = EngineChaos(sc["seed"], sc["mode"], sc["p"])
    ex = CheckedEngine(
        policy, model, kv_capacity=sc["kv_capacity"], max_num_seqs=sc["max_num_seqs"],
        max_batch_tokens=sc["max_batch_tokens"], eviction=sc["eviction"],
        snapkv_window=sc["snapkv_window"], offload_suspended=sc["offload"], skip_idle=True,
        prefix_cache_tokens=sc["prefix_cache"],
    )  # fmt: skip
    r = random.Random(sc["seed"])
    want = {
        j.request.rid: solo_answer(
            model, j.request.prompt_token_ids or (), min(j.output_len, j.request.max_tokens)
        )
        for j in jobs
    }
    min_tokens: dict[int, int] = {}
    if sc["eos"]:  # an id some answer really produces early, so that EOS stops happen
        ex.eos_token_id = r.choice([t for ids in want.values() for t in ids[:3]])
        for rid in want:
            if r.random() < 0.5:
                min_tokens[rid] = m = r.choice([0, 1, 2])
                ex.stop_tokens[rid] = StopRule(frozenset({ex.eos_token_id}), m)
    if sc["text_segments"]:
        for j in jobs:
            if not j.segments and r.random() < 0.5:
                ex.segmenters[j.request.rid] = TextSegmenter(_BAR, _bar_text)
    aborted: set[int] = set()
    if sc["aborts"]:

        def on_tokens(produced: list[tuple[int, int]]) -> None:
            if r.random() < 0.1:
                rid = r.randrange(len(jobs) + 2)  # sometimes one the engine never saw
                seq = ex.seqs.get(rid)
                live = seq is not None and seq.status < SeqStatus.FINISHED
                assert ex.abort(rid) == live  # harmless on finished and unknown requests
                if live:
                    aborted.add(rid)

        ex.on_tokens = on_tokens
    res = ex.run(jobs, max_wall_s=30.0)
    note(f"counters={res.counters} preemptions={res.preemptions} aborted={aborted}")
    assert not ex.in_system, "the run did not end"
    # everything is freed: cache, books, spool, observation windows
    assert not ex.kv.slots
    assert ex.kv.total_tokens == 0
    assert ex.kv_used == 0
    assert ex.kv_device == 0
    assert ex.spooled_at_close == {}
    assert ex._spool is None  # the spool directory is gone
    assert not ex.kv.watching
    assert not ex._chains
    assert res.kv_peak <= sc["kv_capacity"]
    for rec in res.records:
        rid = rec.request.rid
        assert (rec.finish is None) != (rec.cancelled_at is None), rec
        if rec.finish is None:
            continue
        out = res.outputs[rid]
        assert len(out) == rec.output_tokens == rec.target_tokens
        expect = want[rid]
        if rid in min_tokens:  # the answer ends at its first allowed end-of-sequence
            stops = [k for k, t in enumerate(expect) if t == ex.eos_token_id]
            stops = [k for k in stops if k + 1 >= min_tokens[rid]]
            expect = expect[: stops[0] + 1] if stops else expect
        else:
            assert len(out) == len(expect)
        if rid not in policy.evicted:
            assert out == expect, rid
    assert res.tokens_generated >= sum(rec.output_tokens for rec in res.records)


# --- greedy answers do not depend on what runs around them ----------------------


def test_alone_batched_chunked_and_preempted_answers_equal_transformers(
    hf: Any, model: Gemma3
) -> None:
    r = random.Random(3)
    jobs = [_job(i, _prompt(r, r.randint(1, 30)), r.randint(1, 12)) for i in range(8)]
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
    prompt = _prompt(random.Random(4), 37)
    one_shot = greedy_generate(model, [list(prompt)], 10)[0]
    for chunk in (1, 2, 3, 5, 8, 36):
        assert greedy_generate(model, [list(prompt)], 10, chunk_size=chunk)[0] == one_shot


# --- edges ---------------------------------------------------------------------------


def test_an_answer_that_exactly_fills_the_kv_needs_no_preemption(model: Gemma3) -> None:
    prompt = _prompt(random.Random(5), 20)
    # the last token is produced, never fed back: prompt + output - 1 KV tokens
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=20 + 12 - 1)
    res = ex.run([_job(0, prompt, 12)])
    assert res.outputs[0] == solo_answer(model, prompt, 12)
    assert res.preemptions == 0
    assert res.kv_peak == 31
    assert ex.kv.total_tokens == 0


def test_an_answer_one_token_too_long_for_the_kv_is_cancelled_cleanly(model: Gemma3) -> None:
    prompt = _prompt(random.Random(5), 20)
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=20 + 12 - 2)
    res = ex.run([_job(0, prompt, 12)])
    rec = res.records[0]
    assert rec.cancelled_at is not None
    assert rec.finish is None
    assert res.outputs[0] == solo_answer(model, prompt, 12)[:11]  # what it had was right
    assert not ex.kv.slots
    assert ex.kv.total_tokens == 0


def test_a_prompt_that_can_never_fit_is_rejected_and_holds_nothing(model: Gemma3) -> None:
    ex = CheckedEngine(make_policy("fcfs"), model, kv_capacity=10)
    res = ex.run([_job(0, tuple(range(10)), 1), _job(1, tuple(range(9)), 1)])
    assert res.records[0].cancelled_at is not None
    assert res.counters["rejected"] == 1
    assert res.outputs[1] == solo_answer(model, tuple(range(9)), 1)  # prompt + 1 = capacity fits
    assert not ex.kv.slots


def test_many_tiny_requests_at_limits_of_one(model: Gemma3) -> None:
    r = random.Random(6)
    jobs = [
        _job(i, _prompt(r, 1), r.choice([1, 2]), max_tokens=r.choice([1, 64])) for i in range(40)
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
    jobs = [_job(0, tuple(range(1, 9)), 4), _job(1, tuple(range(1, 30)), 20)]
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
    res = ex.run([_job(0, prompt, 3)])
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
    ex.admit_arrival(_job(0, prompt, 8))
    ex.tick()
    ex.tick()
    with pytest.raises(ExecutorError, match="duplicate request id 0"):
        ex.admit_arrival(_job(0, (1, 2, 3), 8))
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
    job = _job(0, tuple(range(1, 21)), 4)
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
    model.step([SeqChunk(slot, list(_prompt(random.Random(0), 40)), 0)], kv)
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
        _job(0, _prompt(r, 1), 30),
        _job(1, _prompt(r, 1), 6, segments=(1, 5), gaps=(0.05,)),
        _job(2, _prompt(r, 1), 30),
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
