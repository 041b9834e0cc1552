"""End-to-end tests of `duetime serve` on a tiny random-weight model, each on a server of
its own: admission refusing deadlines it cannot meet (and counting a prompt the prefix
cache holds as the copy it is), a failing step that fails its requests while the server
goes on, /health reporting a hung engine, and finished requests leaving no policy state.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from duetime.server.app import create_app
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, tiny_state, wait_idle


def test_admission_refuses_unreachable_deadlines(tmp_path: Path) -> None:
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "coefficients": {"c0": 0.5, "b": 0.01}}))
    state = tiny_state(profile=profile)
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 200})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert "deadline" in r.json()["error"]["message"]
        # Allowing KV eviction turns the refusal into a degraded acceptance.
        ok = httpx.post(
            url + "/v1/completions",
            json={**body, "max_tokens": 2, "deadline_ms": 200, "kv_eviction": "auto"},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
        # A fixed ratio of 0 evicts nothing, so it is refused as "off" is (it was accepted).
        zero = httpx.post(
            url + "/v1/completions", json={**body, "deadline_ms": 200, "kv_eviction": 0.0}
        )
        assert zero.status_code == 429, zero.text
        # A deadline the estimate can meet is accepted outright.
        fine = httpx.post(
            url + "/v1/completions", json={**body, "max_tokens": 2, "deadline_ms": 60_000}
        )
        assert fine.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'duetime_rejected_total{why="deadline"} 2.0' in metrics
        wait_idle(state)


def test_a_failing_step_fails_its_requests_and_the_server_goes_on() -> None:
    state = tiny_state()
    ex = state.engine.executor
    real_step = ex.model.hidden_states  # the forward every step runs
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step(*args, **kwargs)

    ex.model.hidden_states = flaky  # type: ignore[method-assign]  # shared by rebuilt executors
    try:
        with serve_in_thread(create_app(state)) as url:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 500
            assert "boom" in r.json()["error"]["message"]
            r2 = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r2.status_code == 200, r2.text
            assert state.engine.stats.engine_errors == 1
            wait_idle(state)
    finally:
        ex.model.hidden_states = real_step  # type: ignore[method-assign]


def test_health_reports_a_hung_engine_and_recovers_when_it_moves() -> None:
    """A step that never returned left /health at 200 (the thread was alive), so a
    gateway kept routing to the hung backend until each request timed out."""
    state = tiny_state(stall_after_s=1.0)
    ex = state.engine.executor
    real_step = ex.model.hidden_states  # the forward every step runs
    release = threading.Event()

    def hangs(*args: object, **kwargs: object) -> object:
        release.wait(30)
        return real_step(*args, **kwargs)

    ex.model.hidden_states = hangs  # type: ignore[method-assign]
    try:
        with serve_in_thread(create_app(state)) as url:
            assert httpx.get(url + "/health").status_code == 200  # idle: nothing held
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
                deadline = time.monotonic() + 20
                while (r := httpx.get(url + "/health")).status_code == 200:
                    assert time.monotonic() < deadline, "a hung engine stayed healthy"
                    time.sleep(0.1)
                assert r.status_code == 503
                assert "stalled" in r.json()["status"]
                ex.model.hidden_states = real_step  # type: ignore[method-assign]
                release.set()
                assert answer.result().status_code == 200
            assert httpx.get(url + "/health").status_code == 200
            wait_idle(state)
    finally:
        release.set()
        ex.model.hidden_states = real_step  # type: ignore[method-assign]


def test_retired_requests_leave_no_policy_state() -> None:
    """A long-running server forgets each finished request, in the executor and the policy."""
    state = tiny_state(policy="timebill")
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 60_000})
            assert r.status_code == 200, r.text
        wait_idle(state)
        policy = state.engine.executor.policy
        assert policy._evicted == set()  # type: ignore[attr-defined]
        assert not state.engine.executor.records


def test_admission_counts_a_cached_prompt_as_the_copy_it_is(tmp_path: Path) -> None:
    """A prompt whose beginning the prefix cache holds is judged by the prefill it still
    needs: with 10 ms per prefill token, a 400-token prompt cannot answer in 1.5 s, but
    the same prompt again (all but its last 32 tokens cached) can; another long prompt
    still cannot."""
    profile = tmp_path / "prefill-bound.json"
    coefficients = {"c0": 0.001, "a1": 0.01}  # 10 ms a prefill token, 1 ms a decode step
    profile.write_text(json.dumps({"name": "prefill-bound", "coefficients": coefficients}))
    state = tiny_state(profile=profile)
    with serve_in_thread(create_app(state)) as url:
        prompt = "The warehouse robot waits for its next order. " * 9  # 415 bytes
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 1500})
        assert first.status_code == 429, first.text  # 4.1 s of prefill predicted
        warm = httpx.post(url + "/v1/completions", json=body, timeout=60)  # no deadline
        assert warm.status_code == 200, warm.text
        assert state.engine.cached_prefix_len(state.codec.encode(prompt)) >= 352
        again = httpx.post(url + "/v1/completions", json={**body, "deadline_ms": 1500}, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 352
        other = {**body, "prompt": prompt.upper(), "deadline_ms": 1500}
        assert httpx.post(url + "/v1/completions", json=other).status_code == 429
        wait_idle(state)
