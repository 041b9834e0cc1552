"""The server counts the requests on their way to admission (arrived, their lengths
being predicted), so that the first of a burst is judged knowing of the others."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from duetime.core.request import LengthPrediction, Request
from duetime.server.app import ServerState, create_app
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, char_state, post_and_hang_up


class _HeldPredictor:
    """Four tokens a request; its first batch waits until ``n`` requests are on their way."""

    def __init__(self, state: ServerState, n: int) -> None:
        self.state, self.n, self.batches = state, n, 0

    def predict_requests(self, reqs: Sequence[Request]) -> list[LengthPrediction]:
        self.batches += 1
        give_up = time.monotonic() + 10
        while self.batches == 1 and self.state.arriving < self.n:
            assert time.monotonic() < give_up, "the other requests never arrived"
            time.sleep(0.002)
        return [LengthPrediction.exact(4.0) for _ in reqs]


class _FailingPredictor:
    def predict_requests(self, reqs: Sequence[Request]) -> list[LengthPrediction]:
        raise RuntimeError("the predictor broke")


def _judged_with(state: ServerState) -> list[tuple[int, int]]:
    """Record each admission's sequences and the ``arriving`` it is told of."""
    seen: list[tuple[int, int]] = []
    admit = state.admission.admit

    def spy(jobs: Any, **kw: Any) -> Any:
        seen.append((len(jobs), kw["arriving"]))
        return admit(jobs, **kw)

    state.admission.admit = spy  # type: ignore[method-assign]
    return seen


def test_the_first_of_a_burst_is_judged_knowing_of_the_others_on_their_way() -> None:
    state = char_state(kv_capacity=1024)
    state.predictor = _HeldPredictor(state, 5)  # type: ignore[assignment]
    seen = _judged_with(state)
    bodies = [
        {"model": MODEL, "prompt": "go", "max_tokens": 4, "deadline_ms": 60_000},
        {"model": MODEL, "prompt": "go", "max_tokens": 4, "n": 2},  # two sequences
        {"model": MODEL, "prompt": ["go", "stop"], "max_tokens": 4},  # two prompts
    ]
    with serve_in_thread(create_app(state)) as url, ThreadPoolExecutor(3) as pool:
        sent = pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=30), bodies)
        assert [r.status_code for r in sent] == [200, 200, 200]
    # each judged knew of the sequences of those not yet judged (5 in all, all arrived
    # before the first was judged)
    assert sorted(n for n, _ in seen) == [1, 2, 2]
    judged = 0
    for n, arriving in seen:
        judged += n
        assert arriving == 5 - judged, seen
    assert state.arriving == 0


def test_a_request_that_fails_or_leaves_before_admission_is_no_longer_arriving() -> None:
    state = char_state(kv_capacity=1024)
    state.predictor = _FailingPredictor()  # type: ignore[assignment]
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 500
    assert state.arriving == 0
    state = char_state(kv_capacity=1024)
    app = create_app(state, manage_engine=False)
    body_bytes = json.dumps({"model": MODEL, "prompt": "hello", "n": 3}).encode()
    assert post_and_hang_up(app, "/v1/completions", body_bytes)[0]["status"] == 499
    assert state.arriving == 0
