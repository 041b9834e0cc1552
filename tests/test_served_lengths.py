"""The length predictor corrected online by the served model's own answers.

The predictor learned ShareGPT's answers; the served model writes others (base
Gemma 3 270M writes to ``max_tokens`` nearly always). The server keeps the newest
finished answers and watches the running ones (Kaplan-Meier over the ratio of
answer to prediction, cut and unfinished answers censored) and corrects each new
prediction by them.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest

from duetime.core.request import Job, LengthPrediction
from duetime.predict.served_lengths import ServedLengths, kaplan_meier_quantiles
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.threaded import serve_in_thread


def _km(values: list[float], ended: list[bool], *levels: float) -> list[float]:
    return kaplan_meier_quantiles(np.array(values), np.array(ended), levels)


def test_without_censoring_kaplan_meier_is_the_sample_quantile() -> None:
    rng = np.random.default_rng(0)
    x = rng.exponential(size=101)
    levels = (0.05, 0.5, 0.95)
    got = kaplan_meier_quantiles(x, np.ones(len(x), dtype=bool), levels)
    want = np.quantile(x, levels, method="inverted_cdf")
    assert got == pytest.approx(want.tolist())


def test_kaplan_meier_counts_a_censored_value_at_risk_until_it_drops_out() -> None:
    """1, 3, 5 ended; 2 and 4 censored. S: 4/5 after 1; 4/5 * 2/3 = 0.533 after 3
    (three at risk); 0 after 5. A plain quantile of the events (1, 3, 5) has its
    median at 3; Kaplan-Meier's CDF is 0.467 there, so the median is 5."""
    assert _km([1, 2, 3, 4, 5], [True, False, True, False, True], 0.2, 0.3, 0.5) == [1, 3, 5]
    # a censoring tied with an event is still at risk at the event
    assert _km([1, 1, 2], [True, False, True], 0.34) == [2]


def test_kaplan_meier_never_reaches_a_quantile_past_its_last_event() -> None:
    assert _km([1, 2, 3], [False, False, False], 0.5) == [math.inf]
    assert _km([1, 2, 3], [True, False, False], 0.3, 0.5) == [1, math.inf]
    assert _km([], [], 0.5) == [math.inf]


def _answers(served: ServedLengths, n: int, point: float, tokens: int, reason: str) -> None:
    for rid in range(n):
        served.start(rid, point)
        served.end(rid, tokens, reason)


def test_a_model_that_writes_to_the_cap_is_predicted_to() -> None:
    """Every answer cut by max_tokens 512 where 100 tokens were predicted: a new request
    predicted 100 (or 300) with max_tokens 512 is now predicted 512."""
    served = ServedLengths(min_answers=16)
    _answers(served, 20, point=100, tokens=512, reason="length")
    corr = served.correction()
    assert math.isinf(corr.mid)
    for point in (100.0, 300.0):
        pred = LengthPrediction(point=point, lo=point / 2, hi=point * 1.5)
        got = served.correct(pred, 512, corr)
        assert got.point == 512
        assert got.hi == 512
        assert got.confidence == served.coverage
    # the cap of the request at hand still bounds it
    assert served.correct(LengthPrediction(100, 50, 150), 64, corr).point == 64


def test_a_model_that_writes_half_the_prediction_is_predicted_half() -> None:
    """Answers ending on their own at half the predicted point (predictions 50-400):
    a new prediction of 200 becomes 100, its interval around it."""
    served = ServedLengths(min_answers=16)
    for rid, point in enumerate(np.linspace(50, 400, 40)):
        served.start(rid, float(point))
        served.end(rid, round(point / 2), "stop")
    got = served.correct(LengthPrediction(200, 100, 400), 1000, served.correction())
    assert got.point == pytest.approx(100, rel=0.03)
    assert got.lo <= got.point <= got.hi < 200


def test_running_answers_count_as_at_least_as_long_as_they_are() -> None:
    """Nothing finished yet (a cold start: each point starts at its interval's top):
    20 answers each already twice their predicted 100 tokens say the next is at
    least 2x its prediction; 20 answers 3 tokens in say nothing more."""
    served = ServedLengths(min_answers=16)
    for rid in range(20):
        served.start(rid, 100)
    pred = LengthPrediction(150, 60, 200)
    long = served.correct(pred, 4096, served.correction([(rid, 200) for rid in range(20)]))
    assert (long.point, long.hi) == (300, 300)  # 150 * 2
    short = served.correct(pred, 4096, served.correction([(rid, 3) for rid in range(20)]))
    assert (short.point, short.lo, short.hi) == (200, 60, 200)
    # progress of requests it does not follow is no evidence
    other = served.correction([(rid, 200) for rid in range(100, 120)])
    assert served.correct(pred, 4096, other).point == 200


def test_a_cold_start_is_careful_and_aborts_are_forgotten() -> None:
    """Until 16 answers have finished, a point is its interval's top (an optimistic
    start fills the engine for the next minute); the 16th answer ends the cold start."""
    served = ServedLengths(min_answers=16)
    pred = LengthPrediction(100, 50, 300)
    assert served.correct(pred, 4096, served.correction()).point == 300
    for rid in range(15):
        served.start(rid, 100)
        served.end(rid, 60, "stop")  # the model writes 0.6x the prediction
    assert served.correction().cold
    assert served.correct(pred, 4096, served.correction()).point == 300
    served.start(99, 100)
    served.end(99, 7, "abort")  # a client that left says nothing of the length
    served.end(98, 512, "length")  # never started: not followed
    assert served.running == 0
    assert served.summary() == (15, 0.0)
    assert served.correction().cold
    served.start(15, 100)
    served.end(15, 60, "stop")
    warm = served.correction()
    assert not warm.cold
    assert served.correct(pred, 4096, warm).point == 60
    assert served.correct(pred, 4096, None) == pred  # no correction: as predicted


def test_one_outlier_does_not_decide_where_the_unended_answers_go() -> None:
    """Answers cut at 1.5x the prediction, one cut at 100x: the floor is their 90th
    percentile (1.5x), not the outlier."""
    served = ServedLengths(min_answers=16)
    _answers(served, 30, point=100, tokens=150, reason="length")
    served.start(1000, 1)
    served.end(1000, 100, "length")
    corr = served.correction()
    assert corr.floor == pytest.approx(math.log(1.5))
    assert served.correct(LengthPrediction(100, 50, 200), 4096, corr).point == pytest.approx(150)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        ServedLengths(window=0)
    with pytest.raises(ValueError, match="coverage"):
        ServedLengths(coverage=1.0)
    options = ServeOptions(model="tiny", predictor=None, length_window=-1)
    model, codec, name = load_served_model(options)
    with pytest.raises(ValueError, match="length_window"):
        build_state(options, model, codec, name)


# --- through the server ---------------------------------------------------------------
class _FourTokens:
    """A length predictor that always says 4 tokens (the tiny model writes to the cap)."""

    name = "four"

    def predict_job(self, job: Job) -> LengthPrediction:
        return LengthPrediction(point=4.0, lo=2.0, hi=6.0, confidence=0.9)


def _state(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, **kw)
    monkeypatch.setattr("duetime.server.build._predictor", lambda _options: _FourTokens())
    model, codec, name = load_served_model(options)
    return build_state(options, model, codec, name), name


@pytest.mark.parametrize("window", [1000, 0])
def test_the_server_learns_its_model_writes_to_max_tokens(
    monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """20 answers of 16 tokens (EOS banned: they stop only at max_tokens) to a
    predictor that says 4: the next request is predicted 16, unless the window is
    off. An ``ignore_eos`` answer is exactly max_tokens and teaches nothing."""
    state, name = _state(monkeypatch, length_window=window)
    body = {"model": name, "prompt": "hello", "max_tokens": 16, "logit_bias": {"1": -100}}
    with serve_in_thread(create_app(state)) as url:
        first = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        # cold (no answer finished yet): the top of the predictor's interval, 6
        assert first["duetime"]["predicted_tokens"] == (6 if window else 4)
        for _ in range(19):
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.json()["choices"][0]["finish_reason"] == "length"
        later = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        forced = {**body, "ignore_eos": True, "max_tokens": 8}
        exact = httpx.post(url + "/v1/completions", json=forced, timeout=30).json()
        metrics = httpx.get(url + "/metrics", timeout=30).text
    assert later["duetime"]["predicted_tokens"] == (16 if window else 4)
    assert exact["duetime"]["predicted_tokens"] == 8  # ignore_eos: exactly max_tokens
    if window:
        assert state.served_lengths.summary() == (21, 1.0)  # ignore_eos answers teach nothing
        assert state.served_lengths.running == 0
        assert "duetime_served_length_answers 21.0" in metrics
        assert "duetime_served_length_cut_ratio 1.0" in metrics
    else:
        assert state.served_lengths is None
        assert "duetime_served_length" not in metrics
