"""The real executor on a tiny random-weight Gemma 3: same policies, exact outputs, no KV leaks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.rescored_head import RescoredInt8Head
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.policies.base import QueuePolicy
from tests.factories import EvictAfterPrefill, tiny_engine_profile


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _jobs(n: int, seed: int = 0, segmented: bool = False) -> list[Job]:
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        p = r.randint(1, 40)
        ids = tuple(r.randrange(256) for _ in range(p))
        o = r.randint(1, 24)
        segs: tuple[int, ...] = ()
        gaps: tuple[float, ...] = ()
        if segmented and o >= 2:
            cut = r.randint(1, o - 1)
            segs, gaps = (cut, o - cut), (0.002,)
        req = Request(rid=i, arrival=0.0, prompt_len=p, prompt_token_ids=ids, max_tokens=64)
        jobs.append(Job(req, o, segs, gaps))
    return jobs


def _reference(model: Any, jobs: list[Job]) -> dict[int, list[int]]:
    longest = max(j.output_len for j in jobs)
    outs = greedy_generate(model, [list(j.request.prompt_token_ids or ()) for j in jobs], longest)
    return {j.request.rid: outs[k][: j.output_len] for k, j in enumerate(jobs)}


def test_fcfs_outputs_equal_plain_greedy_and_kv_returns_to_zero(model: Any) -> None:
    jobs = _jobs(12)
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=10_000, max_batch_tokens=64)
    res = ex.run(jobs)
    assert res.outputs == _reference(model, jobs)
    assert all(r.finish is not None for r in res.records)
    assert ex.kv.total_tokens == 0
    assert not ex.slots


def test_recompute_preemption_keeps_the_greedy_continuation(model: Any) -> None:
    jobs = _jobs(10, seed=3)
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=120, max_batch_tokens=32)
    res = ex.run(jobs)
    assert res.preemptions > 0  # the point of the test: memory was short
    assert res.kv_peak <= 120
    assert res.outputs == _reference(model, jobs)
    assert ex.kv.total_tokens == 0


def test_segments_suspend_and_resume_without_reprefill(model: Any) -> None:
    jobs = _jobs(8, seed=4, segmented=True)
    ex = EngineExecutor(make_policy("edf"), model, kv_capacity=10_000)
    res = ex.run(jobs)
    assert res.outputs == _reference(model, jobs)
    # a resumed segment continues from its kept KV: every prompt token ran exactly once
    assert ex.prefill_tokens == sum(j.request.prompt_len for j in jobs)
    assert res.tokens_generated == sum(j.output_len for j in jobs)
    assert sum(len(r.segment_done) for r in res.records) > len(jobs)  # segments happened
    assert ex.kv.total_tokens == 0


class _Chaos(QueuePolicy):
    """FCFS plus random cancels, suspends, resumes and preemptions (seeded)."""

    name = "chaos"

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        busy = {rid for rid, _ in dec.prefill} | set(dec.preempt) | set(dec.cancel)
        busy |= set(dec.resume)
        for s in list(snap.running):
            x = self.rng.random()
            if s.rid in busy:
                continue
            if x < 0.03:
                dec.cancel.append(s.rid)
            elif x < 0.08 and s.prefill_done:
                dec.suspend.append(s.rid)
            elif x < 0.11:
                dec.preempt.append(s.rid)
        return dec


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chaos_policy_never_leaks_kv_and_finished_outputs_stay_exact(model: Any, seed: int) -> None:
    jobs = _jobs(14, seed=10 + seed)
    ex = EngineExecutor(_Chaos(seed), model, kv_capacity=300, max_batch_tokens=48)
    res = ex.run(jobs)
    ref = _reference(model, jobs)
    for rec in res.records:
        rid = rec.request.rid
        assert (rec.finish is None) != (rec.cancelled_at is None)
        if rec.finish is not None:
            assert res.outputs[rid] == ref[rid]
    assert ex.kv.total_tokens == 0
    assert not ex.slots


def test_missing_prompt_ids_is_a_clear_error(model: Any) -> None:
    ex = EngineExecutor(make_policy("fcfs"), model)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        ex.run([Job(Request(rid=0, arrival=0.0, prompt_len=3), 2)])


def test_swap_preemption_spools_kv_and_resumes_it_exactly(model: Any) -> None:
    jobs = _jobs(10, seed=3)
    ex = EngineExecutor(
        make_policy("fcfs", preempt_mode="swap"), model, kv_capacity=120, max_batch_tokens=32
    )
    res = ex.run(jobs)
    assert res.counters["swaps"] > 0
    # swapped KV comes back bit for bit: no token of any answer changes
    assert res.outputs == _reference(model, jobs)
    assert ex.prefill_tokens == sum(j.request.prompt_len for j in jobs)  # no recompute
    assert ex.kv.total_tokens == 0
    assert ex._spool is None  # the spool directory is gone


def test_telemetry_has_one_line_per_step(model: Any, tmp_path: Any) -> None:
    import json

    path = tmp_path / "steps.jsonl"
    ex = EngineExecutor(make_policy("fcfs"), model, telemetry=path)
    ex.run(_jobs(4))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == ex.engine_steps
    assert {"step_s", "prefill_tokens", "decode_seqs", "kv_tokens_attended", "rss_bytes"} <= set(
        rows[0]
    )
    assert rows[0]["prefill_tokens"] > 0
    assert torch.tensor([r["step_s"] for r in rows]).min() > 0


def test_validate_compares_engine_and_simulator_per_request(model: Any, tmp_path: Any) -> None:
    from duetime.bench import validate

    prof = tiny_engine_profile(model, tmp_path / "tiny.json")
    jobs = _jobs(6, seed=7)
    for k, j in enumerate(jobs):
        j.request.arrival = 0.01 * k
    fig = validate.run(
        model=model, profile=prof, requests=6, jobs=jobs, plot=tmp_path / "v.png",
        kv_capacity=10_000, max_num_seqs=8, max_batch_tokens=64,
    )  # fmt: skip
    assert fig["requests_compared"] == 6
    assert fig["e2e_rel_err_median_pct"] is not None
    assert fig["e2e_rel_err_median_pct"] >= 0
    # the profile priced the real run's own steps, every one of them in the table
    assert fig["step_mape_pct"] is not None
    assert sum(row["steps"] for row in fig["step_misses"]) == fig["real_steps"]
    assert fig["step_seconds_real_over_model"] > 0
    assert (tmp_path / "v.png").stat().st_size > 5_000


def test_restart_preemption_regenerates_the_same_answer(model: Any) -> None:
    jobs = _jobs(10, seed=3)
    ex = EngineExecutor(
        make_policy("fcfs", preempt_mode="restart"), model, kv_capacity=120, max_batch_tokens=32
    )
    res = ex.run(jobs)
    assert res.counters.get("restarts", 0) > 0
    assert res.outputs == _reference(model, jobs)
    assert ex.kv.total_tokens == 0


def test_a_restarted_answer_is_replayed_not_resampled(model: Any) -> None:
    """Once restarted, the model here would pick other tokens (as another batch's rounding
    can on a near-tie); what the client was already sent must not change under it."""
    jobs = _jobs(10, seed=3)
    ex = EngineExecutor(
        make_policy("fcfs", preempt_mode="restart"), model, kv_capacity=120, max_batch_tokens=32
    )
    voided: dict[int, list[int]] = {}
    on_restart = ex._on_restart

    def spy(seq: Any) -> None:
        answer = ex.tokens[seq.rid][seq.req.prompt_len :]
        if len(answer) > len(voided.get(seq.rid, [])):
            voided[seq.rid] = list(answer)
        on_restart(seq)

    ex._on_restart = spy  # type: ignore[method-assign]
    assert not isinstance(model.lm_head, RescoredInt8Head)  # every pick goes through logits
    logits_of = model.logits

    def drifted(hidden: Any, **kw: Any) -> torch.Tensor:
        logits = logits_of(hidden, **kw)
        if voided:  # after the first restart every argmax is token 7
            logits = logits.clone()
            logits[:, 7] = logits.max() + 1.0
        return logits

    try:
        model.logits = drifted
        res = ex.run(jobs)
    finally:
        del model.logits
    assert voided
    for rid, before in voided.items():
        assert res.outputs[rid][: len(before)] == before
        assert set(res.outputs[rid][len(before) :]) <= {7}
    assert not ex._replay  # every replay ran to its end
    assert ex.kv.total_tokens == 0


def test_streaming_llm_eviction_keeps_accounting_exact_and_frees_everything(model: Any) -> None:
    r = random.Random(5)
    jobs = []
    for i in range(6):
        ids = tuple(r.randrange(256) for _ in range(40 + 5 * i))  # past the window of 4
        jobs.append(Job(Request(rid=i, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids), 12))
    ex = EngineExecutor(
        EvictAfterPrefill(0.5), model, kv_capacity=10_000, eviction="streaming"
    )  # checks every step
    res = ex.run(jobs)
    assert all(rec.output_tokens == 12 for rec in res.records)
    assert all(rec.kv_evicted_ratio == 0.5 for rec in res.records)
    assert ex.kv.total_tokens == 0
    # eviction changes what the model sees, so the text may change, but not its length
    assert all(len(res.outputs[j.request.rid]) == 12 for j in jobs)


def test_evicting_nothing_changes_nothing(model: Any) -> None:
    jobs = _jobs(6, seed=8)
    res = EngineExecutor(EvictAfterPrefill(0.0), model).run(jobs)
    assert res.outputs == _reference(model, jobs)


def test_streaming_llm_keeps_sinks_and_recent_positions(model: Any) -> None:
    from duetime.engine.eviction import streaming_llm_evict

    kv = model.new_kv_cache()
    slot = kv.allocate()
    from duetime.engine import SeqChunk

    model.step([SeqChunk(slot, list(range(30)), 0)], kv)
    streaming_llm_evict(kv, slot, 20, sinks=4)
    glob = model.config.sliding_layers.index(False)
    assert kv.positions(slot, glob)[0].tolist() == [0, 1, 2, 3, *range(24, 30)]
    assert kv.num_tokens(slot) == 10


def test_skip_idle_jumps_over_gaps_and_keeps_the_trace_times(model: Any) -> None:
    """A trace with a 1,000 s gap replays in compute time; times stay on the trace's axis."""
    jobs = _jobs(2, seed=5)
    late = jobs[1].request
    jobs[1] = Job(
        Request(rid=1, arrival=1000.0, prompt_len=late.prompt_len,
                prompt_token_ids=late.prompt_token_ids, max_tokens=64),
        jobs[1].output_len,
    )  # fmt: skip
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=10_000, skip_idle=True)
    res = ex.run(jobs)
    assert res.outputs == _reference(model, jobs)
    assert 990.0 < ex.idle_skipped_s <= 1000.0
    second = res.records[1]
    assert second.first_token is not None
    assert 1000.0 <= second.first_token < 1000.0 + 60.0  # served when it arrived, not early
    assert res.wall_s >= 1000.0
    assert ex.kv.total_tokens == 0
