"""Admission by forecast through a served tiny model over HTTP.

A server that forecasts reports ``predicted_e2e_ms`` and refuses a request a full
batch would make late; only a forecasting server keeps an image of its engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.threaded import serve_in_thread
from tests.admission_images import STEP_S, slow_server


def test_the_server_reports_its_forecast_and_refuses_a_full_batch(tmp_path: Path) -> None:
    """Through HTTP, one slot (``max_num_seqs`` 1) and a prior of 50 ms a step: an answer
    with a deadline carries ``predicted_e2e_ms``; while a long answer holds the slot, a
    short one with a tight deadline is refused with the forecast's reason."""
    state, model, name = slow_server(tmp_path, max_num_seqs=1)
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
