"""Regression tests for bugs that ``tests/test_server_properties.py`` found in how the
server holds up while it serves: a client gone before its request reaches the engine,
tokenizing and length prediction kept off the event loop, a body that stops coming,
and the engine's image ready before its first round.

Each test is the smallest case that failed before its fix; the property test
is what finds the next one.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from duetime.core.request import Job, LengthPrediction
from duetime.server.app import create_app
from duetime.server.codec import ByteCodec
from duetime.server.gateway import GatewayConfig, create_gateway_app
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, char_state, post_and_hang_up


def _answered_meanwhile(
    url: str, blocked: dict[str, Any], waiting: threading.Event, release: threading.Event
) -> httpx.Response:
    """Send ``blocked`` and, once it waits (``waiting``), another request, which must be
    answered before ``release`` lets the first go on. The first request's response."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url + "/v1/completions", json=blocked, timeout=60)
        try:
            assert waiting.wait(10), "the first request never reached the blocking step"
            other = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=other, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
        finally:
            release.set()
        return first.result()


def test_a_client_gone_before_its_request_is_submitted_costs_the_engine_nothing() -> None:
    """A client that hung up right after sending still had its request submitted, and
    the engine ran its prefill until the answer's disconnect watch aborted it (0.25 s
    later for a whole answer, at the first token for a stream). Checked before the
    submit, it never reaches the engine."""
    state = char_state(kv_capacity=1024)
    app = create_app(state, manage_engine=False)  # nothing drains the engine's inbox
    for stream in (False, True):
        body = json.dumps({"model": MODEL, "prompt": "hello", "stream": stream}).encode()
        sent = post_and_hang_up(app, "/v1/completions", body)
        assert sent[0]["status"] == 499, sent
        assert state.engine.inbox_size == 0


class _SlowCodec(ByteCodec):
    """The byte codec, whose encoding of long texts waits for ``release`` (as a 1 MB
    prompt keeps a real tokenizer busy for a third of a second)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) > 10_000:
            self.waiting.set()
            self.release.wait(30)
        return super().encode(text)


def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """Prompts were tokenized on the event loop: while a 1 MB one took ~0.3 s, no other
    client got a token, an answer or even /health. Long ones now go to a worker thread."""
    codec = _SlowCodec()
    with serve_in_thread(create_app(char_state(codec=codec, kv_capacity=1024))) as url:
        body = {"model": MODEL, "prompt": "x" * 20_000, "max_tokens": 2}
        long = _answered_meanwhile(url, body, codec.waiting, codec.release)
        assert long.status_code == 400  # longer than the context: refused


class _SlowPredictor:
    """Predicts 8 tokens, after ``release`` for a prompt that asks to wait (as a
    fine-tuned encoder takes 7-15 ms a prompt, longer under load)."""

    name = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = threading.Event()

    def predict_job(self, job: Job) -> LengthPrediction:
        if job.request.prompt_text == "wait":
            self.waiting.set()
            self.release.wait(30)
        return LengthPrediction(point=8.0, lo=1.0, hi=16.0)


def test_the_length_predictor_runs_off_the_event_loop() -> None:
    """Each request's length prediction ran on the event loop: while it ran, no other
    client got a token or an answer. It now runs on its own worker thread."""
    state = char_state(kv_capacity=1024)
    predictor = _SlowPredictor()
    state.predictor = predictor
    with serve_in_thread(create_app(state)) as url:
        body = {"model": MODEL, "prompt": "wait", "max_tokens": 2}
        answer = _answered_meanwhile(url, body, predictor.waiting, predictor.release)
        assert answer.status_code == 200, answer.text
        assert answer.json()["duetime"]["predicted_tokens"] == 2.0  # capped by max_tokens


def _half_request_answer(url: str) -> bytes:
    """Send headers and half a body, then wait: what the server answers, once it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        answer = b""
        while chunk := conn.recv(4096):  # the server closes after a 408
            answer += chunk
        return answer


@pytest.mark.parametrize("server", ["serve", "gateway"])
def test_a_body_that_stops_coming_is_a_408(server: str) -> None:
    """A client that sent half a request held its connection and a handler until
    shutdown (and then kept the server up: see test_serve_shutdown.py)."""
    if server == "serve":
        state = char_state(kv_capacity=1024)
        state.config.body_timeout_s = 0.5
        app = create_app(state)
    else:
        gw_config = GatewayConfig(body_timeout_s=0.5, health_interval_s=60)
        app = create_gateway_app(["http://127.0.0.1:9"], gw_config)
    with serve_in_thread(app) as url:
        answer = _half_request_answer(url)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 0.5 s" in answer
        metrics = httpx.get(url + "/metrics").text
        if server == "serve":
            assert (
                'duetime_http_responses_total{route="/v1/completions",status="408"} 1.0' in metrics
            )
        else:
            assert 'duetime_gateway_requests_total{outcome="http_408"} 1.0' in metrics


def test_the_engine_image_exists_before_the_first_round() -> None:
    """A request admitted before the engine thread's first round found no image and was
    judged by the estimate instead of a forecast (the structured-output tests failed 3 of 4
    runs on a loaded machine for it)."""
    state = char_state()
    loop = state.engine
    loop._idle_wait_s = 30.0  # the thread's round may come much later
    loop.start()
    try:
        assert loop.image is not None
        assert loop.stats.alive
    finally:
        loop.stop()
