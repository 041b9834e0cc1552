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

The edges, the decisions a policy must not make and the regressions are in
``test_engine_edges.py``.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from duetime.core.request import Job
from duetime.core.sequence import SeqStatus
from duetime.engine.executor import StopRule
from duetime.engine.gemma3 import Gemma3
from duetime.engine.segment_stop import SegmentRule, TextSegmenter
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from tests.engine_checks import CheckedEngine, EngineChaos, engine_job, solo_answer


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(seed=1)  # sliding window 4: shorter than most prompts below


@pytest.fixture(scope="module")
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf)


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
            engine_job(
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
        jobs.append(engine_job(i, prompt, o, max_tokens=64))
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
