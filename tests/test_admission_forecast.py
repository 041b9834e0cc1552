"""Admission by forecast: the engine's image played forward under the served policy.

The estimate a formula gives sees only the queue's prefill and the batch as it is;
a forecast also sees the batch slot a request must wait for, the requests accepted
but not yet on the engine, and the other choices of the same request.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from duetime.core.cost import LinearStepCost
from duetime.core.grammar import AnswerWork
from duetime.core.image import EngineImage
from duetime.core.policy import Policy
from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.edf import EDF
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission, assumed_answer
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.engine_loop import EngineStats
from duetime.server.forecast_errors import ForecastErrors
from duetime.server.recent_load import RecentLoad
from duetime.server.step_timer import StepTimer
from duetime.server.threaded import serve_in_thread
from duetime.sim.simulator import SimConfig, Simulator

STEP_S = 0.05  # every step 50 ms, whatever it holds
COST = LinearStepCost.batch(c=STEP_S, a=0.0, b=0.0, d=0.0)


def _busy_image(max_num_seqs: int = 1) -> tuple[EngineImage, EngineStats]:
    """One request decoding, 90 of its 100 tokens to go (4.5 s), in a batch of one."""
    sim = Simulator(make_policy("edf"), COST, SimConfig(max_num_seqs=max_num_seqs, max_time=0.5))
    busy = Request(rid=1, arrival=0.0, prompt_len=16, max_tokens=100)
    busy.predicted = LengthPrediction.exact(100)
    sim.run([Job(busy, output_len=100)])
    image = sim.image()
    assert [s.generated for s in image.seqs] == [10]
    stats = EngineStats(now=image.now, running=1, kv_used=25, kv_capacity=sim.kv_capacity)
    return image, stats


def _ask(rid: int, tokens: int, now: float) -> Job:
    req = Request(rid=rid, arrival=now, prompt_len=8, max_tokens=tokens, deadline=now + 2.0)
    req.predicted = LengthPrediction.exact(tokens)
    return Job(req, output_len=tokens)


def _admission(forecast: bool) -> Admission:
    timer = StepTimer(prior=COST)
    return Admission(timer, policy=(lambda: make_policy("edf")) if forecast else None)


def test_a_request_that_must_wait_for_the_batch_is_refused_by_the_forecast_only() -> None:
    """The estimate counts 5 steps of 50 ms and accepts; the forecast knows the one
    slot is taken for 4.5 s more and refuses, saying when it would finish."""
    image, stats = _busy_image()
    args = {"stats": stats, "queued": 0, "budget_s": 3.0, "allows_eviction": False, "cached": {}}
    job = _ask(2, 5, image.now)
    assert _admission(False).admit([job], **args).accept  # type: ignore[arg-type]
    verdict = _admission(True).admit([job], image=image, **args)  # type: ignore[arg-type]
    assert not verdict.accept
    assert verdict.why == "deadline"
    assert "forecast of the engine (1 other requests on it" in verdict.reason
    assert "5 tokens assumed" in verdict.reason
    assert "more like" not in verdict.reason
    finish = 0.05 * 90 + 0.05 * 5  # the slot frees after 90 steps, then its own 5
    assert verdict.predicted_finish_s is not None
    assert abs(verdict.predicted_finish_s - finish) < 0.06
    assert verdict.retry_after_s == 2  # ceil(4.75 - 3)
    # Past twice its budget the forecast stops looking: "not within"
    short = _admission(True).admit([job], image=image, **{**args, "budget_s": 2.0})  # type: ignore[arg-type]
    assert not short.accept
    assert "not within 4000 ms" in short.reason
    assert short.predicted_finish_s is None
    assert short.retry_after_s == 2
    # With a second slot it starts at once: accepted, its finish on the request.
    image2, stats2 = _busy_image(max_num_seqs=2)
    fine = _ask(3, 5, image2.now)
    ok = _admission(True).admit([fine], image=image2, **{**args, "stats": stats2})  # type: ignore[arg-type]
    assert ok.accept
    assert ok.predicted_finish_s is not None
    assert fine.request.forecast_finish == image2.now + ok.predicted_finish_s
    assert abs(ok.predicted_finish_s - 5 * STEP_S) < 0.06  # (prefill + 4 decode steps)


def test_the_forecast_runs_the_fork_the_image_holds_not_a_fresh_policy() -> None:
    """The engine's image carries its policy's fork (with the state it remembers); the
    admission's factory makes a fresh one only for an image that holds none."""
    image, stats = _busy_image(max_num_seqs=2)
    assert isinstance(image.policy, EDF)
    made: list[Policy] = []

    def fresh() -> Policy:
        made.append(make_policy("edf"))
        return made[-1]

    args = {"stats": stats, "queued": 0, "budget_s": 3.0, "allows_eviction": False, "cached": {}}
    adm = Admission(StepTimer(prior=COST), policy=fresh)
    assert adm.admit([_ask(2, 5, image.now)], image=image, **args).accept  # type: ignore[arg-type]
    assert made == []
    bare = dataclasses.replace(image, policy=None)
    assert adm.admit([_ask(3, 5, image.now)], image=bare, **args).accept  # type: ignore[arg-type]
    assert len(made) == 1


def test_the_forecast_counts_accepted_requests_not_yet_on_the_engine_and_every_choice() -> None:
    """Two slots, one taken for 4.5 s: a 30-token request fits in the other (1.5 s)
    alone, not behind one accepted a moment ago that the engine has not taken yet, nor
    as two choices of one request. A refusal names the choice that misses."""
    image, stats = _busy_image(max_num_seqs=2)
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    adm = _admission(True)
    adm.recent.least = 10**9  # no load expected beyond what is named here
    assert adm.admit([_ask(2, 30, image.now)], image=image, **args).accept  # type: ignore[arg-type]
    before = _ask(3, 30, image.now)
    late = adm.admit([_ask(4, 30, image.now)], image=image, pending=[before], **args)  # type: ignore[arg-type]
    assert not late.accept
    pair = [_ask(5, 30, image.now), _ask(6, 30, image.now)]
    both = adm.admit(pair, image=image, **args)  # type: ignore[arg-type]
    assert not both.accept
    assert both.which == 1
    # A job being handed over is in the image and in the pending list: counted once.
    held = adm.admit(
        [_ask(7, 30, image.now)],
        image=image,
        pending=[Job(image.seqs[0].request, output_len=100)],
        **args,  # type: ignore[arg-type]
    )
    assert held.accept
    # Allowing eviction accepts it, degraded; with no deadline nothing is forecast.
    evict = adm.admit(pair, image=image, **{**args, "allows_eviction": True})  # type: ignore[arg-type]
    assert evict.accept
    assert evict.degraded
    free = adm.admit(pair, image=image, **{**args, "budget_s": None})  # type: ignore[arg-type]
    assert free.accept
    assert free.predicted_finish_s is None


class _NoFork(EDF):
    def fork(self) -> EDF:
        raise RuntimeError("no policy today")


def test_a_forecast_that_fails_falls_back_to_the_estimate() -> None:
    image, stats = _busy_image()
    image = dataclasses.replace(image, policy=_NoFork())
    adm = Admission(StepTimer(prior=COST), policy=lambda: make_policy("edf"))
    verdict = adm.admit(
        [_ask(2, 5, image.now)],
        stats=stats,
        queued=0,
        budget_s=2.0,
        allows_eviction=False,
        cached={},
        image=image,
    )
    assert verdict.accept
    assert "forecast" not in verdict.reason


def test_assumed_answer_is_the_prediction_then_the_top_of_its_interval() -> None:
    req = Request(rid=1, arrival=0.0, prompt_len=8, max_tokens=300, ignore_eos=False)
    assert assumed_answer(req) == 300  # no prediction: as long as it may be
    assert assumed_answer(req, most=4) == 4  # (a grammar's longest answer)
    req.predicted = LengthPrediction(point=100.4, lo=20, hi=250)
    assert assumed_answer(req) == 101
    assert assumed_answer(req, generated=50) == 101
    assert assumed_answer(req, generated=120) == 250  # past the point: the interval's top
    assert assumed_answer(req, generated=260) == 261  # past both: one more
    assert assumed_answer(req, generated=299) == 300  # never past max_tokens


def _slow_server(tmp_path: Path, **options: Any) -> tuple[Any, Any, str]:
    """A tiny-model server state whose step-cost prior is 50 ms a step (with the model,
    to slow down, and the name clients send)."""
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "coefficients": {"c0": STEP_S}}))
    opts = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile, **options)
    model, codec, name = load_served_model(opts)
    return build_state(opts, model, codec, name), model, name


def test_the_server_reports_its_forecast_and_refuses_a_full_batch(tmp_path: Path) -> None:
    """Through HTTP, one slot (``max_num_seqs`` 1) and a prior of 50 ms a step: an answer
    with a deadline carries ``predicted_e2e_ms``; while a long answer holds the slot, a
    short one with a tight deadline is refused with the forecast's reason."""
    state, model, name = _slow_server(tmp_path, max_num_seqs=1)
    assert state.admission.mode == "forecast"
    real_step = model.hidden_states  # the forward every step runs

    def slow_step(*args: object, **kwargs: object) -> object:
        time.sleep(STEP_S)  # the tiny model as slow as the prior says (refits agree)
        return real_step(*args, **kwargs)

    model.hidden_states = slow_step  # type: ignore[method-assign]
    with serve_in_thread(create_app(state)) as url:
        body = {"model": name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 60_000}, timeout=30)
        assert r.status_code == 200, r.text
        info = r.json()["duetime"]
        # 4 steps of the prior's 50 ms, from an idle engine
        assert abs(info["predicted_e2e_ms"] - 4 * STEP_S * 1000) < 60, info
        plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert plain["duetime"]["predicted_e2e_ms"] is None  # no deadline: none made
        # Hold the slot with a 5 s answer; then 4 tokens within 1 s cannot be had.
        long = {**body, "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as held:
            assert held.status_code == 200
            refused = httpx.post(
                url + "/v1/completions", json={**body, "deadline_ms": 1000}, timeout=30
            )
        assert refused.status_code == 429, refused.text
        assert "forecast" in refused.json()["error"]["message"]


def test_the_forecast_expects_more_requests_like_those_accepted_lately() -> None:
    """Alone, a 30-token answer beside one other finishes in ~1.2 s. Once requests with
    500-token prompts have been accepted 10 a second, the forecast has more arrive
    at that rate, and their prefills hold its decoding up: refused."""
    cost = LinearStepCost.batch(c=0.02, a=0.001, b=0.01, d=0.0)
    sim = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=8, max_time=2.5))
    busy = Request(rid=1, arrival=0.0, prompt_len=16, max_tokens=400)
    busy.predicted = LengthPrediction.exact(400)
    sim.run([Job(busy, output_len=400)])
    image = sim.image()
    stats = EngineStats(now=image.now, running=1, kv_used=40, kv_capacity=sim.kv_capacity)
    adm = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"))
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    alone = adm.admit([_ask(2, 30, image.now)], image=image, **args)  # type: ignore[arg-type]
    assert alone.accept
    assert alone.predicted_finish_s is not None
    assert alone.predicted_finish_s < 1.5
    # (that acceptance is noted too: one of the recent requests)
    for k in range(20):
        t = image.now - 2.0 + 0.1 * k
        seen = Request(rid=100 + k, arrival=t, prompt_len=500, max_tokens=30, deadline=t + 2.0)
        adm.recent.note(Job(seen, output_len=30), 30)
    expected = adm.recent.future(image.now, image.now + 1.0)
    assert 9 <= len(expected) <= 11  # ~10 a second
    crowded = adm.admit([_ask(3, 30, image.now)], image=image, **args)  # type: ignore[arg-type]
    assert not crowded.accept
    assert "more like the recent ones arriving" in crowded.reason


def test_recent_load_replays_the_newest_shapes_at_the_accepted_rate() -> None:
    load = RecentLoad(window_s=10.0)
    shapes = [(0.0, 100, 10), (1.0, 200, 20), (2.0, 300, 30)]
    for i, (t, prompt, answer) in enumerate(shapes):
        load.note(Job(Request(rid=i, arrival=t, prompt_len=prompt), output_len=answer), answer)
    assert load.future(2.5, 100.0) == []  # fewer than 4: no guess
    load.note(Job(Request(rid=3, arrival=3.0, prompt_len=400, deadline=5.0), 40), 40)
    # 4 in the 4 s since the first: one a second
    future = load.future(4.0, 8.5)
    assert [j.request.arrival for j in future] == [5.0, 6.0, 7.0, 8.0]
    assert [j.request.prompt_len for j in future] == [400, 300, 200, 100]  # newest first
    assert [j.output_len for j in future] == [40, 30, 20, 10]
    assert [j.request.rid for j in future] == [-1, -2, -3, -4]
    assert future[0].request.deadline == 7.0
    assert future[1].request.deadline is None
    assert future[0].request.predicted == LengthPrediction.exact(40)
    assert len(load.future(4.0, 1e9, most=7)) == 7
    assert load.future(12.5, 100.0) == []  # the window has let the first three go


# --- `duetime bench admission` -------------------------------------------------------
def test_bench_admission_serves_one_load_per_mode(tmp_path: Path) -> None:
    """A short overload of the tiny model: both modes run the same requests, their
    figures (units in the names) in the JSON, the forecast's error only for it."""
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "admission.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "0.5", "--max-tokens", "16", "--max-context", "150"]
    args += ["--predictor", "none", "--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    forecast, estimate = fig["summary"]["forecast"], fig["summary"]["estimate"]
    assert forecast["sent"] == estimate["sent"] > 10
    assert forecast["errors"] == 0 == estimate["errors"]
    assert forecast["accepted"] + forecast["rejected"] == forecast["sent"]
    assert forecast["forecast_ms_p50"] is not None
    assert estimate["forecast_ms_p50"] is None
    assert forecast["forecast_over_actual_p50"] is not None
    assert estimate["forecast_over_actual_p50"] is None
    assert 0 <= forecast["hit_rate_of_accepted"] <= 1
    assert [r["mode"] for r in fig["runs"]] == ["forecast", "estimate"]
    pairs = fig["runs"][0]["forecast_pairs"]  # each forecast beside what the request lived
    assert len(pairs) == fig["runs"][0]["with_forecast"] >= 1
    assert all(p["predicted_e2e_ms"] > 0 and p["e2e_ms"] > 0 for p in pairs)
    assert [p["arrival_s"] for p in pairs] == sorted(p["arrival_s"] for p in pairs)
    assert "goodput_met_req_s_forecast_vs_estimate" in fig["ratios"]
    assert "hit_rate_of_accepted" in res.output


def test_bench_admission_compares_served_lengths_with_the_predictors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request asks for 16 tokens (``--fixed-max-tokens``), which the tiny model
    nearly always writes, and the predictor says 2: the arm whose lengths the served
    answers correct is nearer the truth than the one taking the predictor's word."""
    from typer.testing import CliRunner

    from duetime.cli import app

    class TwoTokens:
        name = "two"

        def predict_job(self, job: Job) -> LengthPrediction:
            return LengthPrediction(point=2.0, lo=1.0, hi=3.0, confidence=0.9)

    monkeypatch.setattr("duetime.server.build._predictor", lambda _options: TwoTokens())
    path = tmp_path / "lengths.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "5", "--max-tokens", "64", "--max-context", "150", "--modes"]
    args += ["forecast", "--lengths", "served,predictor", "--fixed-max-tokens", "16"]
    args += ["--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    assert fig["fixed_max_tokens"] == 16
    served, raw = fig["summary"]["served"], fig["summary"]["predictor"]  # only lengths vary
    assert [r["arm"] for r in fig["runs"]] == ["served", "predictor"]
    assert served["sent"] == raw["sent"] > 10
    assert raw["length_mae_tokens"] > served["length_mae_tokens"]
    assert "goodput_met_req_s_served_vs_predictor" in fig["ratios"]


def test_bench_admission_with_ignore_eos_knows_every_length(tmp_path: Path) -> None:
    """Every answer runs to its max_tokens: the forecasts' lengths are exact."""
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "eos.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "5", "--max-tokens", "64", "--max-context", "150", "--modes"]
    args += ["forecast", "--fixed-max-tokens", "24", "--ignore-eos", "--predictor", "none"]
    args += ["--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "ignore-EOS" in res.output
    fig = json.loads(path.read_text())
    assert fig["ignore_eos"] is True
    pairs = fig["runs"][0]["forecast_pairs"]
    assert pairs
    assert {p["answer_tokens"] for p in pairs} == {24}


def test_bench_admission_refuses_an_unknown_mode_before_loading() -> None:
    from tests.factories import cli_refused

    cli_refused("bench", "admission", "--model", "tiny", "--modes", "guess", names="--modes")
    cli_refused("bench", "admission", "--model", "tiny", "--lengths", "guess", names="--lengths")
    cli_refused(
        "bench", "admission", "--model", "tiny", "--confidences", "x", names="--confidences"
    )
    cli_refused("bench", "admission", "--model", "tiny", "--confidences", "1.5", names="(0, 1)")
    bench = ("bench", "admission", "--model", "tiny")
    cli_refused(*bench, "--burst-gaps", "soon", names="--burst-gaps")
    cli_refused(*bench, "--burst-gaps", "-5", names="--burst-gaps")
    cli_refused(*bench, "--arrival", "weibull", names="--arrival")
    cli_refused(*bench, "--burst-size", "6", names="for --arrival bursts, not poisson")
    cli_refused("serve", "--model", "tiny", "--burst-gap-ms", "-1", names="--burst-gap-ms")
    for args in (
        ["--deadline-confidence", "most"],
        ["--admission", "estimate", "--deadline-confidence", "0.9"],
    ):
        cli_refused("serve", "--model", "tiny", *args, names="--deadline-confidence")


def test_a_grammar_bound_stands_in_for_a_missing_prediction() -> None:
    """No length predictor, ``max_tokens`` 64 but a grammar that ends within 4 tokens:
    judged as 4 tokens by both modes (64 steps of 50 ms would miss 2 s)."""
    image, stats = _busy_image(max_num_seqs=2)
    args = {"stats": stats, "queued": 0, "budget_s": 2.0, "allows_eviction": False, "cached": {}}
    for forecast in (True, False):
        req = Request(rid=2, arrival=image.now, prompt_len=8, max_tokens=64, deadline=image.now + 2)
        job = Job(req, output_len=64)
        assert not _admission(forecast).admit([job], image=image, **args).accept  # type: ignore[arg-type]
        bounded = _admission(forecast).admit([job], image=image, longest=4, **args)  # type: ignore[arg-type]
        assert bounded.accept, forecast


def test_only_a_forecasting_server_images_its_engine() -> None:
    """The image costs a little every round: a server judging by the estimate keeps none."""
    for mode in ("forecast", "estimate"):
        options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, admission=mode)
        model, codec, name = load_served_model(options)
        state = build_state(options, model, codec, name)
        with serve_in_thread(create_app(state)) as url:
            body = {"model": name, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert (state.engine.image is not None) == (mode == "forecast"), mode


# --- a target hit rate: the forecast stretched by its recent errors -----------------------
def test_the_margin_is_the_conformal_quantile_of_at_risk_forecasts_errors() -> None:
    errors = ForecastErrors(0.9, min_samples=20)
    for k in range(19):
        errors.observe(10.0, 10.0 * (k + 1) / 10, budget_s=12.0)
    assert errors.margin() == 1.0  # 19 < 20: the plain forecast
    errors.observe(0.2, 5.0, budget_s=12.0)  # forecast far inside its budget: not at risk
    assert errors.samples == 19
    for k in range(19, 100):
        errors.observe(10.0, 10.0 * (k + 1) / 10, budget_s=12.0)
    # ratios 0.1 .. 10.0; the conformal rank ceil(101 * 0.9) = 91
    assert errors.margin() == pytest.approx(9.1)
    with pytest.raises(ValueError, match="confidence"):
        ForecastErrors(1.0)


def test_a_forecast_must_meet_the_deadline_with_the_margin() -> None:
    """Alone on an idle-but-for-one engine, 20 tokens forecast to end in ~1 s of a
    1.5 s budget: accepted by the plain forecast; refused once recent forecasts ran
    1.6x long (the reason names the margin), and its forecast finish stays unstretched."""
    image, stats = _busy_image(max_num_seqs=2)
    args = {"stats": stats, "queued": 0, "budget_s": 1.5, "allows_eviction": False, "cached": {}}

    def ask(rid: int) -> Job:
        req = Request(rid=rid, arrival=image.now, prompt_len=8, max_tokens=20)
        req.deadline = image.now + 1.5
        req.predicted = LengthPrediction.exact(20)
        return Job(req, output_len=20)

    errors = ForecastErrors(0.95, min_samples=5)
    admission = Admission(StepTimer(prior=COST), policy=lambda: make_policy("edf"), errors=errors)
    assert admission.admit([ask(2)], image=image, **args).accept  # type: ignore[arg-type]
    for _ in range(5):
        errors.observe(1.0, 1.6, budget_s=1.5)
    job = ask(3)
    verdict = admission.admit([job], image=image, **args)  # type: ignore[arg-type]
    assert not verdict.accept
    assert "x1.60 for 95% confidence" in verdict.reason
    assert job.request.forecast_finish is not None
    assert job.request.forecast_finish - image.now < 1.5
    with pytest.raises(ValueError, match="forecast"):
        Admission(StepTimer(prior=COST), errors=errors)


def test_the_server_learns_its_forecasts_errors_from_finished_requests(tmp_path: Path) -> None:
    """Requests forecast at 4 steps of 50 ms against a 300 ms budget are at risk: each
    one that finishes leaves its actual / forecast ratio with admission."""
    state, model, name = _slow_server(tmp_path, deadline_confidence=0.9)
    codec = state.codec
    body = {"model": name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    with serve_in_thread(create_app(state)) as url:
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 300}, timeout=30)
            assert r.status_code == 200, r.text
        plain = httpx.post(url + "/v1/completions", json=body, timeout=30)  # no deadline
        assert plain.status_code == 200
    assert state.admission.errors is not None
    assert state.admission.errors.samples == 3
    with pytest.raises(ValueError, match="confidence"):
        build_state(ServeOptions(model="tiny", deadline_confidence=2), model, codec, name)
    # the default confidence stretches forecasts; the estimate has none to stretch
    assert build_state(ServeOptions(model="tiny"), model, codec, name).admission.errors
    estimate = ServeOptions(model="tiny", admission="estimate")
    assert build_state(estimate, model, codec, name).admission.errors is None


def test_bench_admission_names_its_arms_by_what_varies() -> None:
    from duetime.bench.admission import AdmissionBenchConfig, _ratios, arms_of

    conf = arms_of(AdmissionBenchConfig(modes=["forecast"], confidences=[None, 0.95]))
    assert list(conf) == ["plain", "conf0.95"]
    summary = {"plain": {"goodput_met_req_s": 2.0}, "conf0.95": {"goodput_met_req_s": 1.5}}
    assert _ratios(summary, conf) == {"goodput_met_req_s_conf0.95_vs_plain": 0.75}
    both = AdmissionBenchConfig(lengths=["served", "predictor"])
    arms = arms_of(both)
    assert list(arms) == [
        "forecast+served",
        "forecast+predictor",
        "estimate+served",
        "estimate+predictor",
    ]
    summary = {name: {"hit_rate_of_accepted": 1.0 + k} for k, name in enumerate(arms)}
    assert set(_ratios(summary, arms)) == {
        "hit_rate_of_accepted_forecast_vs_estimate_served",
        "hit_rate_of_accepted_forecast_vs_estimate_predictor",
        "hit_rate_of_accepted_served_vs_predictor_forecast",
        "hit_rate_of_accepted_served_vs_predictor_estimate",
    }
    assert list(arms_of(AdmissionBenchConfig())) == ["forecast", "estimate"]
    # a confidence stretches forecasts only: the estimate runs once, compared with each
    mixed = arms_of(AdmissionBenchConfig(confidences=[None, 0.95]))
    assert list(mixed) == ["forecast+plain", "forecast+conf0.95", "estimate"]
    summary = {name: {"goodput_met_req_s": 1.0 + k} for k, name in enumerate(mixed)}
    assert set(_ratios(summary, mixed)) == {
        "goodput_met_req_s_forecast_vs_estimate_plain",
        "goodput_met_req_s_forecast_vs_estimate_conf0.95",
        "goodput_met_req_s_conf0.95_vs_plain_forecast",
    }
    # so do the bursts a forecast expects (0: none, "even")
    bursts = arms_of(AdmissionBenchConfig(burst_gaps=[0.05, 0.0]))
    assert list(bursts) == ["forecast+bursts50ms", "forecast+even", "estimate"]
    assert (bursts["forecast+even"].burst_gap_s, bursts["estimate"].burst_gap_s) == (0.0, 0.0)
    summary = {name: {"goodput_met_req_s": 1.0 + k} for k, name in enumerate(bursts)}
    assert _ratios(summary, bursts) == {
        "goodput_met_req_s_forecast_vs_estimate_bursts50ms": 1 / 3,
        "goodput_met_req_s_forecast_vs_estimate_even": 2 / 3,
        "goodput_met_req_s_bursts50ms_vs_even_forecast": 1 / 2,
    }


def test_accepted_structured_answers_are_forecast_as_the_work_they_were_accepted_for() -> None:
    """A structured answer accepted as 5 steps with 20 forced rows riding in them is
    that work in the forecasts of the requests after it, while it waits to be handed
    over and while it runs; not 40 tokens a step each, which in a batch of one would
    have the next request miss its deadline. Rows cost: 50 ms a step, 10 ms a row."""
    cost = LinearStepCost.batch(c=0.05, a=0.01, b=0.0, d=0.0)
    idle = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=1)).image()
    stats = EngineStats(now=idle.now, running=0, kv_used=0, kv_capacity=idle.kv_capacity)
    args = {"stats": stats, "queued": 0, "allows_eviction": False, "cached": {}, "image": idle}

    def admission() -> Admission:
        adm = Admission(StepTimer(prior=cost), policy=lambda: make_policy("edf"))
        adm.recent.least = 10**9  # no load expected beyond what is named here
        return adm

    structured = _ask(2, 40, idle.now)  # predicted 40 tokens; its grammar's answers: less work
    work = AnswerWork(steps=5, rows=20)
    after = _ask(3, 5, idle.now)
    # prefill 8 rows + 4 steps with 5 rows riding each, then the next one's 8 + 4 steps
    in_time = (0.05 + 0.08) + 4 * (0.05 + 0.05) + (0.05 + 0.08) + 4 * 0.05
    remembering = admission()
    first = remembering.admit([structured], budget_s=2.0, work=work, **args)  # type: ignore[arg-type]
    assert first.accept
    assert first.predicted_finish_s == pytest.approx(0.13 + 0.4)
    waiting = remembering.admit([after], budget_s=1.5, pending=[structured], **args)  # type: ignore[arg-type]
    assert waiting.accept, waiting.reason
    assert waiting.predicted_finish_s == pytest.approx(in_time)
    # on the engine, not yet started: the same
    sim = Simulator(make_policy("edf"), cost, SimConfig(max_num_seqs=1, max_time=0.0))
    sim.run([Job(structured.request, output_len=40)])
    on_engine = sim.image()
    assert [s.generated for s in on_engine.seqs] == [0]
    running = remembering.admit([_ask(4, 5, 0.0)], budget_s=1.5, **{**args, "image": on_engine})  # type: ignore[arg-type]
    assert running.accept
    assert running.predicted_finish_s == pytest.approx(in_time)
    # an admission that never accepted it as structured takes it for 40 steps
    forgetting = admission()
    late = forgetting.admit([after], budget_s=1.5, pending=[structured], **args)  # type: ignore[arg-type]
    assert not late.accept
    assert "5 tokens assumed" in late.reason


def test_what_is_left_of_a_structured_answer_is_its_share_of_steps_and_rows() -> None:
    """Half its tokens made (steps' and riders' alike), half its steps and rows are left,
    the rows spread over the answer's decode steps as ``Job.ride_rows`` counts them."""
    adm = Admission(StepTimer(prior=COST), policy=lambda: make_policy("edf"))
    req = Request(rid=9, arrival=0.0, prompt_len=8, max_tokens=64)
    adm._remember(9, steps=6, rows=18)
    assert adm._assumed(req) == Job(req, output_len=6, ride_rows=18)
    half = adm._assumed(req, generated=12)  # of 6 + 18 tokens
    assert half.output_len == 12 + 3  # 3 steps left
    # 9 rows left over those 3 steps: 3 a step, over the 14 decode steps Job counts
    assert half.ride_rows == 3 * 14
    done = adm._assumed(req, generated=30)  # past what was assumed: one more step
    assert (done.output_len, done.ride_rows) == (31, 0)
    other = Request(rid=10, arrival=0.0, prompt_len=8, max_tokens=64)
    other.predicted = LengthPrediction.exact(20)
    assert adm._assumed(other, generated=4) == Job(other, output_len=20)
