"""Property-based tests of the gateway against backends that misbehave.

Hypothesis draws a fleet of fake OpenAI-compatible backends
(``tests/gateway_fakes.py``): how long each takes to answer, whether it
streams, refuses connections, breaks before or in the middle of a body,
hangs until the gateway's read timeout, answers 4xx / 5xx, or dies for a
while (``/health`` included) and comes back. Clients send a random mix of
completions and chat completions, streamed or not, with or without
``deadline_ms``, ``priority`` and ``max_tokens``; some send a bad field and
some hang up early. The gateway runs in-process, its network replaced by the
fakes. What must hold after every run:

* every client that stayed got exactly one well-formed answer: 200 with the
  bytes of the backend named in ``X-Duetime-Backend`` unchanged, a JSON error,
  or, for a stream that broke, those bytes then one SSE error and ``[DONE]``;
* a request reached at most two backends, two only when the first failed on
  a connection before any byte could reach the client, never the same one;
* no slot leaks: every backend's in-flight and prefilling counts are 0, the queue is empty and
  every upstream body was closed once all clients are done;
* no backend ever held more than ``max_inflight`` requests at once;
* the gateway's own 429 only answers a request that gave a deadline;
* ``/metrics`` counts one outcome per request, matching what clients saw.

``DUETIME_FUZZ_EXAMPLES=500`` searches deeper than the default that CI runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import given, note, settings
from hypothesis import strategies as st

from duetime.server.gateway import GatewayConfig, create_gateway_app
from tests.factories import prometheus_samples
from tests.gateway_fakes import (
    KINDS,
    MODEL,
    Attempt,
    FakeBackend,
    FakeFleet,
    Fate,
    Seen,
    call,
)

EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "30"))
READ_TIMEOUT_S = 0.2  # the gateway's request timeout in these runs: what a hang lasts
HANDLER_LIMIT_S = 30.0  # a request still unanswered after this is a hung handler
_UNREACHED = ("refused", "connect timeout", "broke")  # failures that are safe to retry


@dataclass(frozen=True, slots=True)
class Client:
    rid: int
    chat: bool
    stream: bool
    max_tokens: int | None
    deadline_ms: float | None
    priority: int
    delay_s: float
    leave_after_s: float | None
    bad: bool  # sends a max_tokens the gateway must refuse with 400

    def body(self) -> bytes:
        b: dict[str, Any] = {"model": MODEL, "rid": self.rid, "stream": self.stream}
        if self.chat:
            b["messages"] = [{"role": "user", "content": f"hello {self.rid}"}]
        else:
            b["prompt"] = f"hello {self.rid}"
        if self.max_tokens is not None:
            b["max_tokens"] = self.max_tokens
        if self.bad:
            b["max_tokens"] = 10**12
        if self.deadline_ms is not None:
            b["deadline_ms"] = self.deadline_ms
        if self.priority:
            b["priority"] = self.priority
        return json.dumps(b).encode()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


_fates = st.builds(
    Fate,
    kind=st.sampled_from(("ok",) * 4 + KINDS[1:]),
    status=st.sampled_from([400, 429, 500, 503]),
    after=st.integers(1, 3),
)


@st.composite
def _backend(draw: Any, i: int) -> FakeBackend:
    down = draw(
        st.none() | st.tuples(st.sampled_from([0.0, 0.01, 0.05]), st.sampled_from([0.02, 0.1]))
    )
    return FakeBackend(
        name=f"b{i}",
        fates=draw(st.lists(_fates, min_size=1, max_size=5)),
        latency_s=draw(st.sampled_from([0.0, 0.002, 0.01, 0.03])),
        gap_s=draw(st.sampled_from([0.0, 0.001, 0.01])),
        tokens=draw(st.integers(1, 6)),
        pieces=draw(st.integers(1, 4)),
        down=None if down is None else (down[0], down[0] + down[1]),
    )


@st.composite
def _client(draw: Any, rid: int) -> Client:
    return Client(
        rid=rid,
        chat=draw(st.booleans()),
        stream=draw(st.booleans()),
        max_tokens=draw(st.none() | st.integers(1, 64)),
        deadline_ms=draw(st.none() | st.sampled_from([1.0, 50.0, 300.0, 2000.0, 60000.0])),
        priority=draw(st.integers(-2, 2)),
        delay_s=draw(st.sampled_from([0.0, 0.0, 0.005, 0.02, 0.06])),
        leave_after_s=draw(st.none() | st.none() | st.sampled_from([0.0, 0.005, 0.02, 0.08])),
        bad=draw(st.integers(0, 19)) == 0,
    )


@st.composite
def _scenario(draw: Any) -> tuple[list[FakeBackend], list[Client], GatewayConfig]:
    n_backends = draw(st.integers(1, 3))
    backends = [draw(_backend(i)) for i in range(n_backends)]
    clients = [draw(_client(i)) for i in range(draw(st.integers(1, 12)))]
    config = GatewayConfig(
        max_inflight=draw(st.integers(1, 3)),
        health_interval_s=0.01,
        request_timeout_s=READ_TIMEOUT_S,
        suspect_after_timeouts=draw(st.sampled_from([0, 1, 3])),
        suspect_cooldown_s=draw(st.sampled_from([0.05, 30.0])),
        router=draw(st.sampled_from(["forecast", "forecast", "lor", "round-robin", "random"])),
    )
    return backends, clients, config


async def _run(
    backends: list[FakeBackend], clients: list[Client], config: GatewayConfig
) -> tuple[list[Seen], dict[str, float], dict[str, Any]]:
    """Serve every client, then read /metrics and the gateway's own counts."""
    app = create_gateway_app([b.url for b in backends], config, transport=FakeFleet(backends))
    gw = app.state.gateway
    for b in backends:  # down windows count from now
        b.t0 = time.monotonic()

    async def one(c: Client) -> Seen:
        await asyncio.sleep(c.delay_s)
        work = call(app, "POST", c.path, c.body(), c.leave_after_s)
        return await asyncio.wait_for(work, HANDLER_LIMIT_S)

    async with app.router.lifespan_context(app):
        seen = await asyncio.gather(*(one(c) for c in clients))
        metrics = prometheus_samples(bytes((await call(app, "GET", "/metrics")).body).decode())
        state = {
            "in_flight": {b.url: b.in_flight for b in gw.backends},
            "prefilling": {b.url: b.prefilling for b in gw.backends},
            "queued": len(gw._queue),
        }
    return seen, metrics, state


_SSE_TAIL = re.compile(rb"^(\n\n)?data: (\{.*\})\n\ndata: \[DONE\]\n\n$", re.S)


def _expected_outcome(c: Client, s: Seen, attempts: list[Attempt]) -> str:
    """Check one answer that a client stayed for; returns its /metrics outcome."""
    assert s.error is None, f"the app raised {s.error!r}"
    assert s.complete, "no complete answer"
    assert s.status is not None
    backend = s.headers.get("x-duetime-backend")
    if backend is not None:  # an answer that came from a backend
        served = [a for a in attempts if a.backend == backend]
        assert served, f"{backend} never got request {c.rid}"
        att = served[-1]
        assert att is attempts[-1], "the answer came from an attempt that was not the last"
        assert att.raw == c.body(), "the request body was not passed through unchanged"
        if s.status != 200:
            assert s.status == att.status
            assert bytes(s.body) == bytes(att.sent), "an error body was changed"
            assert "error" in s.json()
            return f"http_{s.status}"
        assert att.status == 200
        body = bytes(s.body)
        if att.finished:
            assert body == bytes(att.sent), "a complete answer was changed"
            return "ok"
        assert c.stream, "a whole answer from a body that broke"
        assert body.startswith(bytes(att.sent)), "streamed bytes were changed or reordered"
        m = _SSE_TAIL.match(body[len(att.sent) :])
        assert m, f"a broken stream must end with one SSE error and [DONE]: {body[-300:]!r}"
        err = json.loads(m.group(2))["error"]
        assert err["backend"] == backend
        assert err["code"] == "backend_failed"
        return "timeout_midstream" if "timed out" in err["message"] else "failed_midstream"
    # The gateway's own error.
    assert s.status >= 400, s.status
    err = s.json()["error"]
    assert isinstance(err["message"], str)
    if s.status == 429:
        assert c.deadline_ms is not None, "a 429 for a request that gave no deadline"
        assert err["code"] == "deadline_unreachable"
    if c.bad:
        assert s.status == 400
    if s.status == 504:  # a backend's read timeout, or no slot came in time
        if attempts:
            assert attempts[-1].failed == "timed out", f"504 after it {attempts[-1].failed}"
        else:
            assert "waiting for a backend" in err["message"]
    if s.status == 502:
        assert attempts, "502 without a backend"
        assert attempts[-1].failed in _UNREACHED, f"502 after it {attempts[-1].failed}"
    return "failed" if s.status == 502 else f"http_{s.status}"


def _check(
    backends: list[FakeBackend],
    clients: list[Client],
    max_inflight: int,
    seen: list[Seen],
    metrics: dict[str, float],
    state: dict[str, Any],
) -> None:
    by_rid: dict[int, list[Attempt]] = {c.rid: [] for c in clients}
    for b in backends:
        for a in b.attempts:
            by_rid[a.rid].append(a)
    retried = 0
    expected: Counter[str] = Counter()
    stayed = 0
    for c, s in zip(clients, seen, strict=True):
        attempts = sorted(by_rid[c.rid], key=lambda a: a.seq)
        assert len(attempts) <= 2, f"request {c.rid} sent {len(attempts)} times"
        if len(attempts) == 2:
            retried += 1
            first, second = attempts
            assert first.backend != second.backend, "retried on the same backend"
            assert first.failed in _UNREACHED, f"retried after it {first.failed}"
            # A stream is relayed from its first 200 byte on; an error answer is read whole.
            assert not (c.stream and first.status == 200 and first.sent), "relayed, then retried"
        if s.left:
            assert s.error is None, f"the app raised {s.error!r}"
            continue
        stayed += 1
        expected[_expected_outcome(c, s, attempts)] += 1
    # No leaks and no overbooking.
    for b in backends:
        assert b.current == 0, f"{b.url} still holds {b.current} upstream requests"
        assert b.peak <= max_inflight, f"{b.url} held {b.peak} > {max_inflight} at once"
    assert all(v == 0 for v in state["in_flight"].values()), state
    assert all(v == 0 for v in state["prefilling"].values()), state
    assert state["queued"] == 0, state
    for b in backends:
        assert metrics[f'duetime_gateway_backend_in_flight{{backend="{b.url}"}}'] == 0
    assert metrics["duetime_gateway_queued"] == 0
    # /metrics agrees with the clients: one outcome each; a leaver's may be any.
    counted: Counter[str] = Counter()
    for k, v in metrics.items():
        if k.startswith("duetime_gateway_requests_total{"):
            counted[k.split('"')[1]] = int(v)
    assert sum(counted.values()) == len(clients), (dict(counted), len(clients))
    assert not (expected - counted), f"metrics {dict(counted)} vs clients {dict(expected)}"
    retries = metrics["duetime_gateway_retries_total"]
    assert retried <= retries <= retried + (len(clients) - stayed)


@settings(derandomize=True, deadline=None, max_examples=EXAMPLES)
@given(_scenario())
def test_every_client_gets_one_answer_and_nothing_leaks(
    scenario: tuple[list[FakeBackend], list[Client], GatewayConfig],
) -> None:
    backends, clients, config = scenario
    note(repr(config))
    for b in backends:
        note(repr(b))
    for c in clients:
        note(repr(c))
    seen, metrics, state = asyncio.run(_run(backends, clients, config))
    for c, s in zip(clients, seen, strict=True):
        note(f"{c.rid}: {s.status} left={s.left} {bytes(s.body)[-160:]!r}")
    _check(backends, clients, config.max_inflight, seen, metrics, state)
