"""SnapKV through the engine executor on the tiny random-weight Gemma 3: exact accounting
under chunked prefill, alpha 0 equal to plain greedy, cancel, swap and eviction of a
swapped sequence exact, the streaming fallback; the serve and bench wiring; and the real
Gemma 3 at half its prompt. The cache-level checks: ``test_engine_eviction.py``."""

from __future__ import annotations

import random
from typing import Any

import pytest

from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies.base import QueuePolicy
from tests.factories import EvictAfterPrefill


@pytest.fixture(scope="module")
def model_w4() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1))  # sliding window 4


# ----------------------------------------------------------------- the executor
def _jobs(n: int, seed: int, out: int = 10) -> list[Job]:
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        ids = tuple(r.randrange(256) for _ in range(r.randint(20, 60)))
        jobs.append(
            Job(Request(rid=i, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids), out)
        )
    return jobs


def test_executor_snapkv_accounting_exact_under_chunked_prefill(model_w4: Gemma3) -> None:
    jobs = _jobs(6, seed=1)
    ex = EngineExecutor(
        EvictAfterPrefill(0.5), model_w4, max_batch_tokens=24
    )  # chunks, checks each step
    assert ex.eviction == "snapkv"
    res = ex.run(jobs)
    assert all(rec.kv_evicted_ratio == 0.5 for rec in res.records)
    assert all(len(res.outputs[j.request.rid]) == 10 for j in jobs)
    assert "snapkv_fallbacks" not in res.counters
    assert ex.kv.total_tokens == 0
    assert not ex.kv.watching  # no observation window outlives its sequence's prefill


def test_alpha_zero_output_equals_plain_greedy(model_w4: Gemma3) -> None:
    jobs = _jobs(5, seed=2)
    res = EngineExecutor(EvictAfterPrefill(0.0), model_w4, max_batch_tokens=32).run(jobs)
    prompts = [list(j.request.prompt_token_ids or ()) for j in jobs]
    ref = greedy_generate(model_w4, prompts, 10)
    assert [res.outputs[j.request.rid] for j in jobs] == ref


def test_cancel_right_after_eviction_frees_everything(model_w4: Gemma3) -> None:
    ex = EngineExecutor(EvictAfterPrefill(0.5, cancel=True), model_w4, max_batch_tokens=16)
    res = ex.run(_jobs(4, seed=3))
    assert res.counters["cancelled"] == 4
    assert ex.kv.total_tokens == 0
    assert not ex.slots
    assert not ex.kv.watching


def test_swap_of_an_evicted_sequence_is_exact(model_w4: Gemma3) -> None:
    jobs = _jobs(4, seed=4)
    plain = EngineExecutor(EvictAfterPrefill(0.5), model_w4, max_batch_tokens=64).run(jobs)
    ex = EngineExecutor(EvictAfterPrefill(0.5, swap=True), model_w4, max_batch_tokens=64)
    swapped = ex.run(jobs)
    assert swapped.counters["swaps"] == 4
    assert swapped.outputs == plain.outputs  # the evicted KV came back bit for bit
    assert ex.kv.total_tokens == 0
    assert ex._spool is None


class _SwapThenEvict(QueuePolicy):
    """Swaps each request out right after its prefill, evicts α while it is on disk,
    and only then lets it resume."""

    name = "swap-then-evict"

    def __init__(self, alpha: float) -> None:
        super().__init__(preempt_mode="swap")
        self.alpha = alpha
        self.swapped: set[int] = set()
        self.evicted: set[int] = set()

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        hold = set()
        for s in snap.running:
            if s.prefill_done and s.rid not in self.swapped and s.rid not in dec.preempt:
                dec.preempt.append(s.rid)
                self.swapped.add(s.rid)
        for s in snap.suspended:
            if s.rid in self.swapped and s.rid not in self.evicted:
                assert s.kv_offloaded
                dec.evict[s.rid] = self.alpha
                self.evicted.add(s.rid)
                hold.add(s.rid)
        dec.resume = [r for r in dec.resume if r not in hold]
        return dec


def test_evicting_a_swapped_out_sequence_equals_evicting_it_in_place(model_w4: Gemma3) -> None:
    jobs = _jobs(3, seed=7)
    plain = EngineExecutor(EvictAfterPrefill(0.5), model_w4, max_batch_tokens=64).run(jobs)
    ex = EngineExecutor(_SwapThenEvict(0.5), model_w4, max_batch_tokens=64)
    res = ex.run(jobs)
    assert res.counters["swaps"] == 3
    assert "snapkv_fallbacks" not in res.counters  # the window travelled with the KV
    assert res.outputs == plain.outputs
    assert ex.kv.total_tokens == 0
    assert not ex.kv.watching


def test_eviction_after_first_decode_falls_back_to_streaming(model_w4: Gemma3) -> None:
    class _Late(EvictAfterPrefill):
        def schedule(self, snap: EngineSnapshot) -> Decision:
            dec = QueuePolicy.schedule(self, snap)
            for s in snap.running:
                if s.generated >= 3 and s.rid not in self.done:
                    dec.evict[s.rid] = self.alpha
                    self.done.add(s.rid)
            return dec

    ex = EngineExecutor(_Late(0.5), model_w4)
    res = ex.run(_jobs(3, seed=5))
    assert res.counters["snapkv_fallbacks"] == 3
    assert ex.kv.total_tokens == 0


def test_streaming_is_still_selectable(model_w4: Gemma3, monkeypatch: Any) -> None:
    ex = EngineExecutor(EvictAfterPrefill(0.5), model_w4, eviction="streaming", max_batch_tokens=24)
    watched: list[int] = []
    monkeypatch.setattr(ex.kv, "watch", lambda slot, w: watched.append(slot))
    res = ex.run(_jobs(3, seed=6))
    assert watched == []  # streaming needs no queries: prefill pays nothing
    assert all(rec.kv_evicted_ratio == 0.5 for rec in res.records)
    assert ex.kv.total_tokens == 0


# ----------------------------------------------------------------- wiring
def test_serve_rejects_an_unknown_eviction_method_before_starting() -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    res = CliRunner().invoke(app, ["serve", "--model", "tiny", "--eviction", "h2o"])
    assert res.exit_code != 0
    assert "eviction must be one of snapkv, streaming" in res.output


def test_served_engine_uses_the_chosen_eviction() -> None:
    from duetime.server.build import ServeOptions, build_state, load_served_model

    options = ServeOptions(model="tiny", policy="timebill", eviction="streaming")
    state = build_state(options, *load_served_model(options))
    assert state.engine.executor.eviction == "streaming"


def test_bench_eviction_on_tiny_writes_json(tmp_path: Any) -> None:
    import json

    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "ev.json"
    args = ["bench", "eviction", "--model", "tiny", "--prompts", "2", "--min-prompt", "30"]
    args += ["--max-prompt", "50", "--new-tokens", "6", "--alphas", "0,0.5", "--repeats", "1"]
    res = CliRunner().invoke(app, [*args, "--threads", "1", "--json", str(path)])
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    assert fig["prefill_plain_s"] > 0
    assert "prefill_overhead_pct" in fig
    rows = {(r["method"], r["alpha"]): r for r in fig["rows"]}
    assert set(rows) == {(m, a) for m in ("snapkv", "streaming") for a in (0.0, 0.5)}
    for m in ("snapkv", "streaming"):  # evicting nothing keeps the full-KV output exactly
        assert rows[(m, 0.0)]["token_f1_vs_full"] == 1.0
        assert rows[(m, 0.0)]["same_prefix_tokens_mean"] == 6


def test_bench_eviction_rejects_bad_ratios() -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    res = CliRunner().invoke(app, ["bench", "eviction", "--model", "tiny", "--alphas", "1.5"])
    assert res.exit_code != 0
    assert "[0, 1)" in res.output
    res = CliRunner().invoke(app, ["bench", "eviction", "--model", "tiny", "--alphas", "x"])
    assert res.exit_code != 0
    assert "--alphas" in res.output


# ----------------------------------------------------------------- the real model
PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "spans about seven million square kilometres, of which about five and a half million "
    "are covered by the rainforest. The region includes territory belonging to nine "
    "nations. Most of the forest lies in Brazil, with sixty percent, followed by Peru with "
    "thirteen percent and Colombia with ten percent. The rainforest represents over half "
    "of the planet's remaining rainforests and holds the largest and most biodiverse tract "
    "of tropical rainforest in the world, with an estimated three hundred ninety billion "
    "individual trees divided into sixteen thousand species. Question: which country holds "
    "most of the Amazon rainforest? Answer:"
)


@pytest.mark.real_model
def test_real_gemma_snapkv_at_half_runs_exactly_accounted_and_frees_memory() -> None:
    from duetime.engine import load_model
    from duetime.tokenizer import encode

    model = load_model(dtype="fp32")
    ids = tuple(encode(PASSAGE))
    assert len(ids) > 100
    job = Job(Request(rid=0, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids), 12)
    ex = EngineExecutor(EvictAfterPrefill(0.5), model, max_batch_tokens=64)  # chunked, checked
    res = ex.run([job])
    assert res.records[0].kv_evicted_ratio == 0.5
    assert "snapkv_fallbacks" not in res.counters
    assert len(res.outputs[0]) == 12
    assert ex.kv.total_tokens == 0
    assert not ex.kv.watching
