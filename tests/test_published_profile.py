"""`duetime serve`'s `GET /v1/profile`: its step-cost model as a profile JSON."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from duetime.core.cost import LinearStepCost
from duetime.server.app import create_app
from duetime.server.threaded import serve_in_thread
from duetime.sim.profiles import load_profile
from tests.test_server import MODEL, _state

COST = LinearStepCost(c0=0.004, a1=2e-5, b=1e-4, d=1e-7, name="measured at start")


def test_no_model_yet_is_503_then_the_online_fit_is_published(tmp_path: Path) -> None:
    state = _state()
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
    state = _state(measured_cost=COST)
    with serve_in_thread(create_app(state)) as url:
        r = httpx.get(url + "/v1/profile/", trust_env=False)  # a trailing slash too
    assert r.status_code == 200
    p = r.json()
    assert p["origin"] == {"kind": "measured at start", "steps": 0}
    assert p["coefficients"]["c0"] == COST.c0
    assert p["coefficients"]["a1"] == COST.a1
    assert p["name"] == f"{MODEL}-served"


def test_a_given_profile_is_named(tmp_path: Path) -> None:
    path = tmp_path / "given.json"
    path.write_text(json.dumps(COST.to_profile()))
    state = _state(profile=path)
    with serve_in_thread(create_app(state)) as url:
        p = httpx.get(url + "/v1/profile", trust_env=False).json()
    assert p["origin"] == {"kind": f"given profile {path}", "steps": 0}
