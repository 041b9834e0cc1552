"""`duetime serve`'s `GET /v1/profile`: its step-cost model as a profile JSON."""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from duetime.core.attention_shape import AttentionShape
from duetime.core.cost import CostModelError, LinearStepCost
from duetime.server.app import create_app
from duetime.server.gateway import Backend, GatewayConfig, create_gateway_app
from duetime.server.gateway_profiles import cost_of
from duetime.server.threaded import serve_in_thread
from duetime.sim.profiles import load_profile
from tests.served import MODEL, tiny_state

COST = LinearStepCost(c0=0.004, a1=2e-5, b=1e-4, d=1e-7, name="measured at start")


def test_no_model_yet_is_503_then_the_online_fit_is_published(tmp_path: Path) -> None:
    state = tiny_state()
    with serve_in_thread(create_app(state)) as url:
        r = httpx.get(url + "/v1/profile", trust_env=False)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_cost_model"
        assert "no step-cost model yet" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"
        # 24 decode steps: past the 16 the online fit waits for
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 24, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.get(url + "/v1/profile", trust_env=False)
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["origin"]["kind"] == "online fit"
    assert p["origin"]["steps"] >= 16
    assert "online fit over" in p["source"]
    assert p["kv_capacity_tokens"] == 4096
    assert p["max_num_seqs"] == state.engine.executor.max_num_seqs
    assert p["max_batch_tokens"] == state.engine.executor.max_batch_tokens
    assert p["served_model"] == MODEL
    path = tmp_path / "served.json"
    path.write_text(json.dumps(p))
    cost, cfg = load_profile(str(path))  # what `duetime sim --profile` reads
    assert cost.decode_step(1, 10) > 0
    assert cost.prefill_time(16) > 0
    assert cfg.kv_capacity == 4096


def test_a_model_measured_at_start_is_published_as_such() -> None:
    state = tiny_state(measured_cost=COST)
    with serve_in_thread(create_app(state)) as url:
        r = httpx.get(url + "/v1/profile/", trust_env=False)  # a trailing slash too
    assert r.status_code == 200
    p = r.json()
    assert p["origin"] == {"kind": "measured at start", "steps": 0}
    assert p["coefficients"]["c0"] == COST.c0
    assert p["coefficients"]["a1"] == COST.a1
    assert p["name"] == f"{MODEL}-served"


def test_a_saved_published_profile_is_refused_by_another_engine(tmp_path: Path) -> None:
    """/v1/profile records the engine it was timed on, as `duetime profile` does: a copy
    saved from an fp32 server is refused by `serve --dtype q8` (it was taken as given)."""
    import torch

    state = tiny_state(measured_cost=COST)
    with serve_in_thread(create_app(state)) as url:
        p = httpx.get(url + "/v1/profile", trust_env=False).json()
    assert p["engine"] == {"dtype": "fp32", "threads": torch.get_num_threads()}
    saved = tmp_path / "served.json"
    saved.write_text(json.dumps(p))
    from tests.factories import cli_refused

    cli_refused(
        *("serve", "--model", "tiny", "--dtype", "q8", "--profile", str(saved)),
        *("--threads", str(torch.get_num_threads())),
        names="was timed on the fp32 engine",
    )


def test_a_given_profile_is_named(tmp_path: Path) -> None:
    path = tmp_path / "given.json"
    path.write_text(json.dumps(COST.to_profile()))
    state = tiny_state(profile=path)
    with serve_in_thread(create_app(state)) as url:
        p = httpx.get(url + "/v1/profile", trust_env=False).json()
    assert p["origin"] == {"kind": f"given profile {path}", "steps": 0}


def test_the_gateway_reads_a_backends_published_model_and_prices_on_it_until_answers() -> None:
    state = tiny_state(measured_cost=COST)
    config = GatewayConfig(health_interval_s=0.2, scrape_interval_s=0, profile_interval_s=0.2)
    # the second backend answers 404 everywhere: not `duetime serve`
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(create_app(state)))
        foreign = stack.enter_context(serve_in_thread(FastAPI()))
        gw = stack.enter_context(serve_in_thread(create_gateway_app([url, foreign], config)))
        health = httpx.get(gw + "/health", trust_env=False).json()
    mine, other = health["backends"]
    assert mine["profile"]["status"] == "ok"
    assert mine["profile"]["origin"] == {"kind": "measured at start", "steps": 0}
    assert mine["profile"]["coefficients"]["c0"] == COST.c0
    assert mine["profile"]["in_use"] is True
    assert other["profile"] == {"read": True, "status": "not published"}


def test_a_published_model_prices_a_request_until_the_backend_answers() -> None:
    b = Backend("http://a")
    assert b.estimates(100, 10) == (b.ttft_s, b.request_time(10))  # nothing published
    b.published.cost = COST
    ttft, alone = b.estimates(100, 10)
    assert ttft == pytest.approx(COST.prefill_time(100))
    assert alone == pytest.approx(ttft + COST.decode_span(9, 1, 100))
    assert b.estimates(400, 10)[0] > ttft  # its own prompt is priced
    b.observe(0.5, 1.4, 10, alpha=0.2)  # answers seen: the moving averages lead
    assert b.estimates(100, 10) == (pytest.approx(0.5), pytest.approx(0.5 + 0.1 * 10))
    seeded = Backend("http://b", seeded=True)
    seeded.published.cost = COST
    assert seeded.estimates(100, 10) == (seeded.ttft_s, seeded.request_time(10))


def test_a_published_profile_body_that_is_no_model_is_refused() -> None:
    assert cost_of(COST.to_profile()) == COST
    # a backend's attention shape comes through: the gateway prices its prompts alike
    shaped = dataclasses.replace(COST, attention=AttentionShape(512, 15, 18, 256))
    assert cost_of(shaped.to_profile()).attention == shaped.attention
    for bad in ({}, {"coefficients": {"zz": 1.0}}, {"coefficients": {"c0": "x"}}, []):
        with pytest.raises(CostModelError):
            cost_of(bad)
