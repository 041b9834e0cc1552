"""Admission by forecast to a target hit rate: the forecast stretched by its errors.

The margin is the conformal quantile of recent at-risk forecasts' actual / forecast
ratios; a forecast must meet the deadline with it, and a server learns those errors
from the requests that finish.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state
from duetime.server.forecast_errors import ForecastErrors
from duetime.server.step_timer import StepTimer
from duetime.server.threaded import serve_in_thread
from tests.admission_images import COST, busy_image, slow_server


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
    image, stats = busy_image(max_num_seqs=2)
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
    state, model, name = slow_server(tmp_path, deadline_confidence=0.9)
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
