"""SnapKV on the tiny random-weight Gemma 3: scores against eager attention, kept sets,
exact token accounting with sliding layers and chunked prefill, memory freed, swap exact."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import SeqChunk, greedy_generate
from duetime.engine.eviction import snapkv_evict, snapkv_scores
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies.base import QueuePolicy
from tests.factories import EvictAfterPrefill

PROMPT = [random.Random(7).randrange(256) for _ in range(40)]


@pytest.fixture(scope="module")
def hf() -> Any:
    # sliding window 16 < prompt 40, and larger than the observation window used below,
    # so sliding layers have entries SnapKV must choose among
    return tiny_hf_model(seed=2, sliding_window=16)


@pytest.fixture(scope="module")
def model(hf: Any) -> Gemma3:
    return engine_from_hf(hf)


@pytest.fixture(scope="module")
def model_w4() -> Gemma3:
    return engine_from_hf(tiny_hf_model(seed=1))  # sliding window 4


def _prefill(model: Gemma3, chunks: list[int], window: int, prompt: list[int] = PROMPT) -> Any:
    kv = model.new_kv_cache()
    slot = kv.allocate()
    kv.watch(slot, window)
    pos = 0
    for n in chunks:
        model.step([SeqChunk(slot, prompt[pos : pos + n], pos)], kv)
        pos += n
    assert pos == len(prompt)
    return kv, slot


@torch.no_grad()
def _eager_scores(hf: Any, prompt: list[int], window: int) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, T]``: softmax(QKᵀ) of the last ``window`` queries from
    transformers' eager attention, summed over those queries and each group's heads."""
    out = hf(torch.tensor([prompt]), output_attentions=True)
    kvh = hf.config.num_key_value_heads
    ref = []
    for att in out.attentions:  # [1, heads, T, T]
        a = att[0, :, -window:, :]
        ref.append(a.reshape(kvh, -1, a.shape[-1]).sum(dim=1))
    return ref


@pytest.mark.parametrize("chunks", [[40], [13, 9, 18], [35, 1, 4]])
def test_scores_equal_eager_attention_weights(hf: Any, model: Gemma3, chunks: list[int]) -> None:
    w = 8  # the window spans chunk borders in the chunked cases
    kv, slot = _prefill(model, chunks, window=w)
    ref = _eager_scores(hf, PROMPT, w)
    rep = model.config.num_heads // model.config.num_kv_heads
    for layer in range(model.config.num_layers):
        ours = snapkv_scores(kv, slot, layer, w)
        pos = kv.positions(slot, layer)
        want = ref[layer].gather(1, pos)
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)
        # every key any window query sees is held: the weights sum to one per query row
        torch.testing.assert_close(ours.sum(-1), torch.full((2,), float(rep * w)))


def _pooled(scores: torch.Tensor, n_prefix: int, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV's pooling written out: a centred window over the prefix, zeros outside."""
    s = scores[:, :n_prefix]
    half = kernel // 2
    out = torch.zeros_like(s)
    for j in range(n_prefix):
        lo, hi = max(0, j - half), min(n_prefix, j + half + 1)
        part = s[:, lo:hi]
        out[:, j] = part.sum(-1) / kernel if pooling == "avg" else part.max(-1).values
    return out


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_kept_positions_are_the_window_plus_the_top_pooled_prefix_per_head(
    hf: Any, model: Gemma3, pooling: str
) -> None:
    w, n_drop, kernel = 8, 28, 7  # keeps 12: fewer than a sliding layer's 15 live entries
    kv, slot = _prefill(model, [17, 23], window=w)
    ref = _eager_scores(hf, PROMPT, w)
    cfg = model.config
    keep = 40 - n_drop
    snapkv_evict(kv, slot, n_drop, window=w, kernel=kernel, pooling=pooling)  # type: ignore[arg-type]
    differ = False
    for layer in range(cfg.num_layers):
        kept = kv.positions(slot, layer)
        if cfg.sliding_layers[layer]:
            # candidates are the 15 live entries (window 16 - 1), more than may stay: its own SnapKV
            live = torch.arange(40 - (cfg.sliding_window - 1), 40)
            assert kept.shape[1] == keep
            assert bool(torch.isin(kept, live).all())
            scores = ref[layer][:, live]
            n_prefix, offset = live.numel() - w, int(live[0])
        else:
            scores, n_prefix, offset = ref[layer], 40 - w, 0
        pooled = _pooled(scores, n_prefix, kernel, pooling)
        for h in range(cfg.num_kv_heads):
            assert kept[h, -w:].tolist() == list(range(40 - w, 40))  # the whole window
            chosen = kept[h, :-w] - offset
            assert chosen.numel() == keep - w
            others = torch.ones(n_prefix, dtype=torch.bool)
            others[chosen] = False
            # top-scored: no dropped prefix entry scores above a kept one (max-pooling ties
            # make the exact set ambiguous, so compare scores, not indices)
            assert float(pooled[h, chosen].min()) >= float(pooled[h, others].max()) - 1e-5
        differ |= kept[0].tolist() != kept[1].tolist()
    assert differ, "random heads should disagree somewhere: per-head selection is the point"
    assert kv.num_tokens(slot) == keep


@pytest.mark.parametrize("chunks", [[40], [5, 30, 5], [1] * 40])
@pytest.mark.parametrize("n_drop", [0, 1, 13, 30, 39])
def test_accounting_is_exact_with_sliding_layers(
    model: Gemma3, model_w4: Gemma3, chunks: list[int], n_drop: int
) -> None:
    for m in (model, model_w4):  # sliding window 16 and 4, both below the 40-token prompt
        kv, slot = _prefill(m, chunks, window=32)
        old = kv.num_tokens(slot)
        assert old == 40
        snapkv_evict(kv, slot, n_drop)
        assert kv.num_tokens(slot) == old - n_drop
        # every layer still holds the newest position, and decoding goes on from there
        assert all(int(kv.positions(slot, i)[:, -1].min()) == 39 for i in range(4))
        m.step([SeqChunk(slot, [3], 40)], kv)
        assert kv.num_tokens(slot) == old - n_drop + 1


def test_fewer_kept_than_the_window_keeps_the_newest(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=32)
    snapkv_evict(kv, slot, 37)
    for layer in range(model.config.num_layers):
        assert kv.positions(slot, layer).tolist() == [[37, 38, 39]] * 2


def test_bad_arguments_are_clear_errors(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=8)
    with pytest.raises(ValueError, match="window"):
        snapkv_evict(kv, slot, 4, window=0)
    with pytest.raises(ValueError, match="odd"):
        snapkv_evict(kv, slot, 4, kernel=6)
    with pytest.raises(ValueError, match="pooling"):
        snapkv_evict(kv, slot, 4, pooling="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        snapkv_evict(kv, slot, -1)
    with pytest.raises(ValueError, match="at least one"):
        snapkv_evict(kv, slot, 40)
    assert kv.num_tokens(slot) == 40  # nothing happened
    other = kv.allocate()
    model.step([SeqChunk(other, PROMPT[:10], 0)], kv)
    with pytest.raises(ValueError, match="no observation window"):
        snapkv_evict(kv, other, 4)
    with pytest.raises(ValueError, match="eviction must be one of"):
        EngineExecutor(EvictAfterPrefill(0.5), model, eviction="h2o")


def test_window_is_freed_and_survives_export(model: Gemma3) -> None:
    kv, slot = _prefill(model, [40], window=8)
    before = kv.nbytes(slot)
    state = kv.export(slot)  # a swap before eviction keeps the window
    assert not kv.watching
    slot2 = kv.restore(state)
    assert kv.nbytes(slot2) >= kv.obs_window(slot2).nbytes  # type: ignore[union-attr]
    ref, ref_slot = _prefill(model, [40], window=8)
    snapkv_evict(kv, slot2, 20, window=8)
    snapkv_evict(ref, ref_slot, 20, window=8)
    for layer in range(4):
        assert torch.equal(kv.positions(slot2, layer), ref.positions(ref_slot, layer))
        assert torch.equal(kv.keys(slot2, layer), ref.keys(ref_slot, layer))
    kv.unwatch(slot2)
    assert kv.nbytes(slot2) < before
    kv.free(slot2)
    assert kv.total_tokens == 0
    assert not kv.watching


def test_evicted_sequence_export_restore_is_bit_exact(model: Gemma3) -> None:
    kv, slot = _prefill(model, [13, 27], window=8)
    snapkv_evict(kv, slot, 25, window=8)
    kv.unwatch(slot)
    model.step([SeqChunk(slot, [5], 40)], kv)
    want = [
        (
            kv.keys(slot, i).clone(),
            kv.positions(slot, i).clone(),
            kv.view(slot, i, 0).values.clone(),
        )
        for i in range(4)
    ]
    slot2 = kv.restore(kv.export(slot))
    for i, (k, p, v) in enumerate(want):
        assert torch.equal(kv.keys(slot2, i), k)
        assert torch.equal(kv.positions(slot2, i), p)
        assert torch.equal(kv.view(slot2, i, 0).values, v)
    assert kv.num_tokens(slot2) == 16


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
