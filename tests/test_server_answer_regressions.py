"""Regression tests for bugs that ``tests/test_server_properties.py`` found in the
server's answers: where a stop string, ``min_tokens`` or the server's timeout ends an
answer, how its tokens and finish reason are counted, and an answer that fails as its
client leaves.

Each test is the smallest case that failed before its fix; the property test
is what finds the next one.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies.fcfs import FCFS
from duetime.server.answers import Meta, whole_answer
from duetime.server.app import ServerState, create_app
from duetime.server.codec import ByteCodec
from duetime.server.engine_loop import EngineLoop
from duetime.server.errors import ApiError
from duetime.server.streams import Outcome
from duetime.server.threaded import serve_in_thread
from tests.served import MODEL, char_state


class _RestartOnce(FCFS):
    """FCFS that restarts each request once, right after its first token (the decision
    holds nothing else, so the request is back in the queue with its answer void)."""

    def __init__(self) -> None:
        super().__init__(preempt_mode="restart")
        self.restarted: set[int] = set()

    def schedule(self, snap: EngineSnapshot) -> Decision:
        for s in snap.running:
            if s.generated >= 1 and s.rid not in self.restarted:
                self.restarted.add(s.rid)
                return Decision(preempt=[s.rid], preempt_mode="restart")
        return super().schedule(snap)


class _Now:
    """An event loop stand-in that runs what it is handed at once, on this thread."""

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)


class _Inbox:
    """A request's stream, read on this thread (the engine loop hands it each round's
    items through ``loop``)."""

    def __init__(self) -> None:
        self.items: list[list[int] | Outcome] = []
        self.closed = False
        self.loop = _Now()

    def deliver(self, item: list[int] | Outcome) -> None:
        self.items.append(item)

    put = deliver


def test_a_restarted_request_that_ends_early_counts_the_tokens_its_client_has() -> None:
    """A policy restarted a request after its first token went out, and the client's stop
    string ended it before the re-run had made that token again: its outcome said 0
    tokens, so /metrics' duetime_generated_tokens_total missed the token the client has
    (found by the server property test under aell, which restarts)."""
    model = engine_from_hf(tiny_hf_model(seed=0, vocab_size=ByteCodec.vocab_size))
    loop = EngineLoop(lambda: EngineExecutor(_RestartOnce(), model, kv_capacity=256))
    ex = loop.executor
    ex.on_tokens = loop._publish_tokens  # what the loop's thread sets; driven by hand here
    ex.start_clock()
    req = Request(rid=1, arrival=0.0, prompt_len=3, max_tokens=8, prompt_token_ids=(2, 70, 71))
    stream = _Inbox()
    loop.submit(loop.submission(Job(req, output_len=8), stream, stop_on_eos=False))  # type: ignore[arg-type]
    loop._drain_inbox()
    while not stream.items:
        assert ex.tick() is None or ex.in_system
        loop._flush()  # the end of the loop's round
    assert stream.items == [[ex.tokens[1][-1]]]  # the first token went out
    ex.tick()  # the policy restarts the request: its answer is void for the books
    assert ex.seqs[1].generated == 0
    loop.finish(1)  # the stop string was in that first token
    loop._drain_inbox()
    (outcome,) = [item for item in stream.items if isinstance(item, Outcome)]
    assert stream.items[-1] is outcome
    assert outcome.finish_reason == "stop"
    assert outcome.output_tokens == 1


def test_a_stop_string_in_the_last_allowed_token_is_counted_as_the_client_saw_it() -> None:
    """The engine ended the answer at max_tokens ("length") in the step that made the
    token holding the stop string; the client rightly got "stop", but /metrics counted
    the request under reason="length" (found by the server property test)."""
    state = char_state(kv_capacity=256)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1, "ignore_eos": True}
    with serve_in_thread(create_app(state)) as url:
        first = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        stop = first["choices"][0]["text"]
        assert len(stop) == 1
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/completions",
                json={**body, "stop": [stop], "stream": stream},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert '"finish_reason":"stop"' in r.text.replace(" ", "")
        metrics = state.metrics.requests
        assert metrics.labels("length")._value.get() == 1  # the first request
        assert metrics.labels("stop")._value.get() == 2


def test_an_answer_past_the_server_timeout_is_a_504_streamed_or_not() -> None:
    """The request timeout fired inside the wait for a token (here: during a long
    prefill), whose TimeoutError no one caught: a 500 "internal error: TimeoutError"
    instead of the documented 504, and a stream that broke off without an error event
    or [DONE] (found by the server property test with a 50 ms server timeout)."""
    # a prefill of ~100 steps, far past the server's timeout
    state = char_state(kv_capacity=1024, max_batch_tokens=8, request_timeout_s=0.05)
    body = {"model": MODEL, "prompt": "a" * 900, "max_tokens": 10, "ignore_eos": True}
    with serve_in_thread(create_app(state)) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "timeout"
        assert "timed out" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "timed out in the server (--request-timeout 0.05 s)" in error["message"]
        # every error object has its four keys, as the docs say (the event had two)
        assert (error["type"], error["param"], error["code"]) == ("server_error", None, "timeout")
        _wait_idle(state)
        assert state.metrics.requests.labels("abort")._value.get() == 2


def _wait_idle(state: ServerState, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while state.engine.executor.seqs or state.engine._live:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.01)


def test_a_stop_string_does_not_end_an_answer_before_min_tokens() -> None:
    """``min_tokens`` is "never stop before this", but a stop string in the first tokens
    ended the answer there ("stop" after 1 token with min_tokens 4). As in vLLM, only a
    stop string that begins after the first min_tokens tokens ends the answer now
    (found by the server property test once it checked the documented contract)."""
    state = char_state(kv_capacity=256)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "ignore_eos": True}
    with serve_in_thread(create_app(state)) as url:
        full = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        text = full["choices"][0]["text"]
        stop = text[1]  # it may be there in the first 4 tokens and later again
        later = text.find(stop, 4)
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/completions",
                json={**body, "stop": [stop], "min_tokens": 4, "stream": stream},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e[6:7] == "{"]
                got = "".join(e["choices"][0]["text"] for e in events)
                final = events[-1]
            else:
                got, final = r.json()["choices"][0]["text"], r.json()
            assert got == (text if later < 0 else text[:later])
            assert final["choices"][0]["finish_reason"] == ("length" if later < 0 else "stop")
            assert final["duetime"]["completion_tokens"] == (12 if later < 0 else later + 1)


class _CancelledAsTimeout:
    """A relay whose wait for tokens turns its cancellation into the server's 504, as
    ``asyncio.wait_for`` on Python 3.11 can when a cancel and its timeout coincide (it
    then raises TimeoutError, which the relay answers with a 504)."""

    def __init__(self) -> None:
        self.aborted = False

    async def deltas(self, timeout: float) -> AsyncIterator[str]:
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            raise ApiError(
                504, "the request timed out in the server", type="server_error"
            ) from None
        yield ""  # an async generator, as Relay.deltas is

    def abort(self) -> None:
        self.aborted = True


class _Gone:
    """A request whose client has left."""

    async def is_disconnected(self) -> bool:
        return True


def test_an_answer_that_fails_as_its_client_leaves_logs_nothing() -> None:
    """The client of a non-streamed answer left; the server cancelled the task that
    collects the answer, and that task ended with the 504 of a timeout that came at the
    same moment (wait_for let it through): nobody read it, so asyncio logged "Task
    exception was never retrieved" with its traceback (found by the server property
    test, which fails on any error the server logs)."""

    async def main() -> list[str]:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, context: errors.append(context["message"])
        )
        relay = _CancelledAsTimeout()
        meta = Meta(model=MODEL, chat=False, prompt_tokens=1)
        response = await whole_answer([relay], meta, _Gone(), 10.0)  # type: ignore[arg-type]
        assert response.status_code == 499
        assert relay.aborted
        await asyncio.sleep(0.05)  # the cancelled task ends (with its 504)
        gc.collect()
        return errors

    assert asyncio.run(main()) == []


def test_a_streamed_chunk_carries_the_log_probabilities_of_its_own_tokens() -> None:
    """Each chunk's ``logprobs`` came one token late: " the" with none, then " capital"
    with " the"'s. A client reading a chunk's text with its figures had them apart. With
    one whole character a token nothing is held back, so every chunk's pieces are its
    text."""
    state = char_state(kv_capacity=256)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 12, "ignore_eos": True,
            "logprobs": 1, "stream": True}  # fmt: skip
    with serve_in_thread(create_app(state)) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    chunks = [(e["choices"][0]["text"], e["choices"][0]["logprobs"]) for e in events]
    texts = [text for text, part in chunks if text]
    assert len(texts) == 12, chunks
    for text, part in chunks:
        assert "".join(part["tokens"] if part else []) == text, chunks
