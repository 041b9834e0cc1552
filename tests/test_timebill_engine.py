"""`duetime bench timebill --engine` on a tiny random-weight Gemma 3: scores, accounting, RLP."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from duetime.bench import timebill_engine as tbe
from duetime.cli import app
from duetime.core.cost import LinearStepCost
from duetime.core.record import RequestRecord
from duetime.core.request import Job, LengthPrediction, Request
from duetime.engine import greedy_generate
from duetime.engine.parallel_predict import ParallelPredictExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.metrics.quality import rouge_l, token_f1
from duetime.policies import make_policy
from duetime.predict.predict_time import PredictTimeModel

PNG = b"\x89PNG\r\n\x1a\n"
# An ETE for the tiny model with a large KV term, so that α* is not 0 at small budgets.
COST = LinearStepCost.timebill(a=0.0, b=1e-5, c=1e-3, p=1e-3, q=1e-3)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _jobs(n: int = 4, seed: int = 0) -> list[Job]:
    r = random.Random(seed)
    jobs = []
    for i in range(n):
        p = r.randint(20, 40)
        ids = (2, *(r.randrange(3, 256) for _ in range(p - 1)))
        text = " ".join(r.choice(WORDS) for _ in range(3 * p))
        req = Request(rid=i, arrival=0.0, prompt_len=p, prompt_token_ids=ids, prompt_text=text)
        jobs.append(Job(req, r.randint(6, 12)))
    return jobs


def _greedy(model: Any, jobs: list[Job]) -> dict[int, list[int]]:
    outs = greedy_generate(model, [list(j.request.prompt_token_ids or ()) for j in jobs], 12)
    return {j.request.rid: outs[k][: j.output_len] for k, j in enumerate(jobs)}


def _row(fig: dict[str, Any], overrun: str, method: str, budget: float) -> dict[str, Any]:
    return next(
        r
        for r in fig["rows"]
        if r["overrun"] == overrun and r["method"] == method and r["budget_s"] == budget
    )


def test_ample_budget_vanilla_scores_one_and_alpha95_is_scored_against_the_reference(
    model: Any,
) -> None:
    jobs = _jobs()
    fig = tbe.run(
        model, jobs=jobs, n_max=12, predictor="oracle", cost=COST,
        methods=("vanilla", "alpha=95%", "timebill"), budgets=(1000.0,),
    )  # fmt: skip
    for key in (
        "budgets_s",
        "budgets_step_s",
        "budgets_job_s",
        "budget_scale_step",
        "decode_step_s",
        "eviction",
        "predictor_timing",
        "reference_job_s",
        "summary",
    ):
        assert key in fig, key  # fmt: skip
    assert fig["eviction"] in ("snapkv", "streaming-llm")
    assert len(fig["rows"]) == 2 * 3
    for o in ("kill", "skip-next"):
        v = _row(fig, o, "vanilla", 1000.0)
        assert v["completion_rate"] == 1.0
        assert v["token_f1_mean"] == 1.0
        assert v["rouge_l_mean"] == 1.0
        assert v["mean_alpha"] == 0.0
    # The 95 % run: every job completes; its score is F1 / ROUGE-L against plain greedy
    # decoding with full KV (computed here independently of the bench's reference run).
    ref = _greedy(model, jobs)
    pol = make_policy("timebill", fixed_alpha=0.95)
    ex = ParallelPredictExecutor(pol, model, cost=COST, max_num_seqs=8, max_batch_tokens=4096)
    outs = ex.run(tbe.periodic(jobs, 1000.0)).outputs
    want_f1 = float(np.mean([token_f1(outs[r], ref[r]) for r in ref]))
    want_rl = float(np.mean([rouge_l(outs[r], ref[r]) for r in ref]))
    a95 = _row(fig, "kill", "alpha=95%", 1000.0)
    assert a95["completion_rate"] == 1.0
    assert a95["mean_alpha"] == pytest.approx(0.95)
    assert a95["token_f1_mean"] == pytest.approx(want_f1)
    assert a95["rouge_l_mean"] == pytest.approx(want_rl)
    assert a95["token_f1_completed_mean"] == pytest.approx(want_f1)


def test_kill_and_skip_next_account_for_a_budget_no_job_can_meet(model: Any) -> None:
    # T = 10 µs: all four jobs are released before the first step ends and every deadline
    # passes. Kill ends them all; Skip-Next lets the first finish late and skips the rest.
    fig = tbe.run(
        model, jobs=_jobs(), n_max=12, predictor="oracle", cost=COST,
        methods=("vanilla",), budgets=(1e-5,),
    )  # fmt: skip
    kill, skip = _row(fig, "kill", "vanilla", 1e-5), _row(fig, "skip-next", "vanilla", 1e-5)
    assert kill["completion_rate"] == 0.0
    assert kill["killed_rate"] + kill["skipped_rate"] == 1.0
    assert kill["token_f1_mean"] == 0.0  # incomplete jobs score 0
    assert kill["token_f1_completed_mean"] is None
    assert skip["completion_rate"] == 0.25
    assert skip["skipped_rate"] == 0.75
    assert skip["killed_rate"] == 0.0
    assert skip["on_time_rate"] == 0.0
    assert skip["token_f1_mean"] == pytest.approx(0.25)  # the late job is exact, 3 × 0
    assert skip["token_f1_completed_mean"] == 1.0


def test_score_gives_incomplete_jobs_zero_and_scores_produced_prefixes() -> None:
    recs = []
    for rid, (finish, cancelled) in enumerate([(1.0, None), (None, 1.5)]):
        req = Request(rid=rid, arrival=0.0, prompt_len=4, deadline=2.0)
        rec = RequestRecord(request=req, target_tokens=4, first_token=0.5, finish=finish)
        rec.cancelled_at = cancelled
        recs.append(rec)
    outputs = {0: [1, 2, 3, 4], 1: [5, 6]}
    ref = {0: [1, 2, 3, 9], 1: [5, 7, 8, 9]}
    s = tbe.score(recs, outputs, ref, "kill")
    assert s["token_f1_mean"] == pytest.approx((0.75 + 0.0) / 2)
    assert s["token_f1_completed_mean"] == pytest.approx(0.75)
    # the killed job produced [5, 6] against the reference's first two tokens [5, 7]
    assert s["token_f1_produced_mean"] == pytest.approx((0.75 + 0.5) / 2)
    assert s["rouge_l_produced_mean"] == pytest.approx((0.75 + 0.5) / 2)


class _SlowPredictor:
    """Answers only after the engine has run a few steps: the executor must wait for it."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def predict_job(self, job: Job) -> LengthPrediction:
        self.release.wait(timeout=5.0)
        n = float(job.output_len)
        return LengthPrediction(point=n, lo=n, hi=n)


def test_policy_sees_the_prediction_when_the_prefill_is_done(model: Any) -> None:
    seen: list[bool] = []
    pol = make_policy("timebill", k=1.0)
    original = pol.eviction_ratio

    def spy(seq: Any, snap: Any) -> float:
        seen.append(seq.req.predicted is not None)
        return original(seq, snap)

    pol.eviction_ratio = spy  # type: ignore[method-assign]
    pred = _SlowPredictor()
    ex = ParallelPredictExecutor(pol, model, predictor=pred, cost=COST, max_batch_tokens=4096)
    threading.Timer(0.2, pred.release.set).start()
    jobs = tbe.periodic(_jobs(2), 1000.0)
    res = ex.run(jobs)
    assert all(r.finish is not None for r in res.records)
    assert seen == [True, True]
    assert all(t.predict_s is not None and t.prefill_s is not None for t in ex.timing.values())


def test_predict_time_model_bounds_the_input_length() -> None:
    tm = PredictTimeModel(a_p=1e-6, b_p=1e-4, c_p=1e-3, max_pieces=512)
    n = tm.max_len(0.01)
    assert tm.time_s(n) <= 0.01 < tm.time_s(n + 1)
    assert tm.max_len(1e-9) == 4  # never below a usable input
    dips = PredictTimeModel(a_p=0.0, b_p=1e-4, c_p=-5e-3, max_pieces=512, floor_s=1e-3)
    assert dips.max_len(1e-9) == 4  # a fit below zero at small N_p does not lift the bound
    assert dips.time_s(8) == 1e-3
    assert tm.max_len(100.0) == 512
    fit = PredictTimeModel.fit([8, 64, 256, 512], [tm.time_s(x) for x in (8, 64, 256, 512)], 512)
    assert fit.a_p == pytest.approx(1e-6)
    assert fit.c_p == pytest.approx(1e-3)


def test_learned_predictor_is_compressed_when_the_prefill_is_short(model: Any) -> None:
    from duetime.predict.predict_time import CompressingRLP

    rlp = CompressingRLP.load("learned")
    text = " ".join(WORDS * 6)
    cut, used = rlp.compress(text, 10)
    assert used == 10
    assert text.startswith(cut)
    assert len(cut) < len(text)
    tm = rlp.calibrate([text], grid=(8, 64), reps=1)
    assert tm.max_pieces == rlp.max_pieces
    # a 1 ms prefill hides almost nothing: the input is cut; a 100 s one hides everything
    rlp.prefill_time = lambda n: 1e-9
    req = Request(rid=0, arrival=0.0, prompt_len=30, max_tokens=64, prompt_text=text)
    assert 1.0 <= rlp.predict_request(req).point <= 64
    assert rlp.calls[-1].pieces_used == 4 < rlp.calls[-1].pieces_full
    rlp.prefill_time = lambda n: 100.0
    rlp.predict_request(req)
    assert rlp.calls[-1].pieces_used == rlp.calls[-1].pieces_full


def test_fine_tuned_predictor_reads_its_whole_prompt_when_the_prefill_hides_it() -> None:
    """minilm-ft reads 96 pieces in context and 512 as a bag: a 150-piece prompt must not be
    cut to 96 (the bag would lose the rest) just because the time model stops at 64."""
    from duetime.predict.predict_time import CompressingRLP

    rlp = CompressingRLP.load("learned:minilm-ft")
    text = " ".join(WORDS * 15)
    assert rlp._pieces(text)[0] > rlp.max_pieces == 96
    rlp.calibrate([text], grid=(8, 64), reps=1)
    rlp.prefill_time = lambda n: 100.0
    req = Request(rid=1, arrival=0.0, prompt_len=160, max_tokens=512, prompt_text=text)
    assert rlp.predict_request(req) == rlp.predict_text(text, 160, 512)
    assert rlp.calls[-1].pieces_used == rlp.calls[-1].pieces_full == rlp.max_pieces
    cut_pred = rlp.predict_text(rlp.compress(text, 64)[0], 160, 512)
    assert cut_pred != rlp.predict_text(text, 160, 512)  # so the cut would have changed it


def test_cli_tiny_engine_end_to_end(tmp_path: Path) -> None:
    j, p = tmp_path / "tb.json", tmp_path / "tb.png"
    args = ["bench", "timebill", "--engine", "--model", "tiny", "--dtype", "fp32",
            "--threads", "1", "--prompts", "2", "--n-max", "6", "--min-prompt", "16",
            "--max-prompt", "64", "--predictor", "oracle", "--method", "vanilla",
            "--method", "alpha=50%", "--json", str(j), "--plot", str(p)]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert p.read_bytes()[:8] == PNG
    fig = json.loads(j.read_text())
    assert len(fig["rows"]) == 2 * 2 * 3
    assert fig["budget_scale"] == "job"
    assert len(fig["budgets_s"]) == 3
    for row in fig["rows"]:
        assert 0.0 <= row["completion_rate"] <= 1.0
        assert 0.0 <= row["token_f1_mean"] <= row["completion_rate"] + 1e-9
    for key in ("predict_p50_s", "predict_p90_s", "prefill_p50_s", "prefill_p90_s"):
        assert fig["predictor_timing"][key] is not None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompts", "3"], "--prompts: only with --engine"),
        (["--engine", "--tasks", "2"], "one periodic task"),
        (["--engine", "--jobs", "5"], "--jobs is for the simulator"),
        (["--engine", "--model", "tiny", "--method", "bogus"], "unknown --method"),
        # a comma list is read as the other list options read theirs: one item is named
        (
            ["--engine", "--model", "tiny", "--method", "vanilla,bogus"],
            "unknown --method ['bogus']",
        ),
        (["--engine", "--model", "tiny", "--budget-scale", "wall"], "--budget-scale"),
        (["--engine", "--model", "nano"], "--model must be one of"),
        (["--engine", "--min-prompt", "600", "--max-prompt", "500"], "--min-prompt"),
    ],
)
def test_cli_bad_options_exit_2_with_a_clear_message(args: list[str], needle: str) -> None:
    r = CliRunner().invoke(app, ["bench", "timebill", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_budgets_scale_the_papers_by_the_median_job_or_the_decode_step() -> None:
    ref = {"job_s": {0: 2.0, 1: 3.0, 2: 9.0}, "decode_step_s": 0.054}
    job, info = tbe.budgets_for(ref, "job")
    assert job == pytest.approx([2.0, 3.0, 4.0])  # 5 / 7.5 / 10 s × (3 s / 7.5 s)
    step, _ = tbe.budgets_for(ref, "step")
    assert step == pytest.approx([10.0, 15.0, 20.0])  # × 54 ms / 27 ms
    assert info["budgets_step_s"] == step
    with pytest.raises(ValueError, match="budget scale"):
        tbe.budgets_for(ref, "wall")
