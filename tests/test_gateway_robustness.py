"""The gateway under odd backends and clients, without subprocesses (mock transports).

Each test pins a bug an adversarial run found: head-of-line blocking across
models, requests for a down model waiting out the timeout, a health loop killed
by a malformed /v1/models, streamed answers read as ~30x slower than they were,
a timed-out stream retried and its backend marked down, huge integers as 500s.
The later ones (fake backends from ``tests/gateway_fakes.py``) pin what the
property-based run and a read of the code found: a 413 missing from /metrics, a
streaming client that left before the first byte holding its backend, a stalled
error answer retried as if its backend were dead, connect timeouts not retried,
and slots lost when a client left at the wrong moment.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.server.errors import ApiError
from duetime.server.gateway import (
    Gateway,
    GatewayConfig,
    Grant,
    _ClientGoneError,
    _open_stream,
    _request_fields,
    _unless_client_leaves,
    model_ids,
    stream_tokens,
)
from duetime.server.load_workload import LoadWorkload
from tests.gateway_fakes import FakeBackend, Fate, call
from tests.gateway_runs import metrics, outcome, request_body, with_fakes


def _gateway(max_inflight: int = 1) -> Gateway:
    gw = Gateway(["http://a", "http://b"], GatewayConfig(max_inflight=max_inflight))
    a, b = gw.backends
    a.up, a.models = True, ["x"]
    b.up, b.models = True, ["y"]
    return gw


def test_a_busy_model_does_not_block_requests_for_another() -> None:
    async def scenario() -> None:
        gw = _gateway()
        a, b = gw.backends
        assert await gw.acquire(16, None, 0, "x") is a  # a is now full
        queued = asyncio.ensure_future(gw.acquire(16, 5.0, 0, "x"))  # waits for a, due first
        await asyncio.sleep(0)
        assert len(gw._queue) == 1
        # b is free: a later "y" request gets it at once (it used to queue behind the "x" one)
        got = await asyncio.wait_for(gw.acquire(16, None, 0, "y"), 1.0)
        assert got is b
        gw.release(a)
        assert await asyncio.wait_for(queued, 1.0) is a

    asyncio.run(scenario())


def test_a_request_for_a_model_whose_backends_are_down_is_503_at_once() -> None:
    async def scenario() -> None:
        gw = _gateway()
        a, _ = gw.backends
        assert await gw.acquire(16, None, 0, "x") is a
        queued = asyncio.ensure_future(gw.acquire(16, None, 0, "x"))
        await asyncio.sleep(0)
        gw.mark(a, False)  # the only "x" backend goes down: the waiter fails now
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(queued, 1.0)
        assert (info.value.status, info.value.code) == (503, "no_backend")
        assert not gw._queue
        with pytest.raises(ApiError, match="no backend serving 'x'") as fresh:
            await asyncio.wait_for(gw.acquire(16, None, 0, "x"), 1.0)
        assert fresh.value.status == 503

    asyncio.run(scenario())


def test_a_waiter_whose_client_left_gives_back_its_queue_place() -> None:
    async def scenario() -> None:
        gw = _gateway()
        await gw.acquire(16, None, 0, "x")
        waiter = asyncio.ensure_future(gw.acquire(16, None, 0, "x"))
        await asyncio.sleep(0)
        assert len(gw._queue) == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not gw._queue

    asyncio.run(scenario())


class _LeavingClient:
    """A request whose client disconnects after ``polls`` checks."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    async def is_disconnected(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_a_client_that_leaves_cancels_the_upstream_work() -> None:
    cancelled = asyncio.Event()

    async def upstream() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> None:
        with pytest.raises(_ClientGoneError):
            await _unless_client_leaves(_LeavingClient(1), upstream(), poll_s=0.01)  # type: ignore[arg-type]
        assert cancelled.is_set()
        assert await _unless_client_leaves(_LeavingClient(9), asyncio.sleep(0, "ok")) == "ok"  # type: ignore[arg-type]

    asyncio.run(scenario())


def _client(handler: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("payload", [{"data": None}, [1, 2], {"data": [1, {"id": 3}]}, "x"])
def test_a_malformed_model_list_does_not_kill_the_probe(payload: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=payload)

    async def scenario() -> None:
        gw = Gateway(["http://a"])
        gw.client = _client(handler)
        await gw.probe(gw.backends[0])  # used to raise TypeError / AttributeError
        assert gw.backends[0].up
        assert gw.backends[0].models == []

    asyncio.run(scenario())
    assert model_ids({"data": [{"id": "m"}, {"id": 5}, "z"]}) == [{"id": "m"}]


def test_stream_length_comes_from_the_last_events_not_their_count() -> None:
    duetime_tail = (
        b'data: {"choices":[{"text":"ab"}]}\n\n'
        b'data: {"choices":[{"text":""}],"duetime":{"e2e_ms":9.0,"completion_tokens":300}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert stream_tokens(duetime_tail) == 300
    usage_tail = b'data: {"choices":[],"usage":{"completion_tokens":42}}\n\ndata: [DONE]\n\n'
    assert stream_tokens(b'{"cut": tr' + b"\n" + usage_tail) == 42
    assert stream_tokens(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n') is None


def test_a_stream_that_times_out_is_504_and_its_backend_stays_up() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no bytes", request=request)

    async def scenario() -> None:
        gw = Gateway(["http://a"])
        gw.connect(httpx.MockTransport(handler), httpx.Timeout(600.0))
        b = gw.backends[0]
        b.up = True
        b.in_flight = 1  # the slot _forward took
        with pytest.raises(ApiError) as info:
            await _open_stream(gw, Grant(b, 0.0, 0.0), "/v1/completions", b"{}", 16)
        assert info.value.status == 504
        assert b.up  # slow is not dead: no retry elsewhere, no "down"
        assert b.in_flight == 0
        assert b.observed == 1  # and its estimate learnt how slow

    asyncio.run(scenario())


@pytest.mark.parametrize("field", ["max_tokens", "deadline_ms"])
def test_huge_integers_are_a_400_not_an_overflow(field: str) -> None:
    with pytest.raises(ApiError) as info:
        _request_fields({"model": "m", field: 10**330}, chat=False)
    assert info.value.status == 400
    assert info.value.param == field


@pytest.mark.parametrize("value", ["NaN", "Infinity", '"0.1"', "true"])
def test_a_profile_seed_must_be_a_finite_number(tmp_path: Path, value: str) -> None:
    p = tmp_path / "p.json"
    p.write_text(f'{{"ttft_s": {value}}}')
    url = "http://127.0.0.1:9"
    r = CliRunner().invoke(cli_app, ["gateway", "--backend", url, "--profile", f"{url}={p}"])
    assert r.exit_code == 2
    assert "finite numbers > 0" in r.output


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ({"prompt_len": 10**11, "output_len": 8}, "exceeds --max-context"),
        ({"prompt_len": 8, "output_len": 8, "deadline": 0.0}, "must be > 0"),
    ],
)
def test_a_load_trace_request_the_server_cannot_take_is_refused(
    tmp_path: Path, line: dict[str, Any], needle: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"rid": 0, "arrival": 0.0, "max_tokens": 8, **line}) + "\n")
    with pytest.raises(ValueError, match=needle):
        LoadWorkload(workload=str(trace)).build(1.0)


# --- found by tests/test_gateway_properties.py and by reading along -------------------
def test_a_body_over_the_limit_is_counted_inmetrics() -> None:
    """The 413 of the body-size middleware never reached requests_total."""

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", b"x" * 2048)
        assert seen.status == 413
        assert outcome(gw, "http_413") == 1

    asyncio.run(with_fakes([FakeBackend("b0")], GatewayConfig(max_body_bytes=1024), scenario))


def test_a_stream_whose_client_leaves_before_the_first_byte_is_closed_upstream() -> None:
    """A streaming client that hung up while the backend had sent nothing yet kept its
    upstream request and slot until the first byte came (or the request timed out)."""

    async def scenario(app: Any, gw: Gateway) -> None:
        silent.gate = asyncio.Event()  # never set: the backend sends nothing
        leaves = call(app, "POST", "/v1/completions", request_body(stream=True), leave_after_s=0.05)
        seen = await asyncio.wait_for(leaves, 20.0)  # the request timeout is 600 s
        assert seen.left
        assert silent.current == 0  # the upstream request was closed
        assert gw.backends[0].in_flight == 0
        assert outcome(gw, "client_gone") == 1

    silent = FakeBackend("b0")
    asyncio.run(with_fakes([silent], GatewayConfig(request_timeout_s=600.0), scenario))


def test_an_error_answer_that_stalls_is_a_504_and_is_not_retried() -> None:
    """A stream answered 5xx whose error body then timed out was taken for a dead
    backend: marked down and retried elsewhere, though it may still be working."""

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", request_body(stream=True))
        assert seen.status == 504
        error = json.loads(seen.body)["error"]
        assert error["code"] == "timeout"  # was null
        assert "Timeout" not in error["message"]  # was "(ReadTimeout)"
        assert not other.attempts  # not retried
        assert gw.backends[0].up  # slow is not dead

    stalls = FakeBackend("b0", fates=[Fate("status_stalled", status=500)])
    other = FakeBackend("b1")
    config = GatewayConfig(request_timeout_s=0.2, health_interval_s=60.0)
    asyncio.run(with_fakes([stalls, other], config, scenario))


@pytest.mark.parametrize("stream", [False, True])
def test_a_connect_timeout_is_retried_on_another_backend(stream: bool) -> None:
    """A connect timeout was a 504 like a read timeout, though nothing reached the
    backend: as with a refused connection, retrying elsewhere is safe."""

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(app, "POST", "/v1/completions", request_body(stream=stream))
        assert seen.status == 200
        assert seen.headers["x-duetime-backend"] == other.url
        assert not gw.backends[0].up
        assert metrics(gw)["duetime_gateway_retries_total"] == 1

    unreachable = FakeBackend("b0", fates=[Fate("connect_timeout")])
    other = FakeBackend("b1")
    asyncio.run(with_fakes([unreachable, other], GatewayConfig(health_interval_s=60.0), scenario))


class _LeavesAsTheSlotFrees:
    """A client whose disconnect check frees the slot its request waits for."""

    def __init__(self, gw: Gateway, ticks: int) -> None:
        self.gw, self.ticks = gw, ticks

    async def is_disconnected(self) -> bool:
        self.gw.release(self.gw.backends[0])  # the slot goes to the waiting request...
        for _ in range(self.ticks):  # ...which may even have taken it by the time we look
            await asyncio.sleep(0)
        return True


@pytest.mark.parametrize("ticks", [0, 3])
def test_a_slot_granted_as_its_client_leaves_is_not_lost(ticks: int) -> None:
    """On Python 3.11 asyncio.wait_for returns a result that arrives with a cancellation,
    and _unless_client_leaves dropped a result that came in while it looked: either
    way the backend lost a slot for good."""

    async def scenario() -> None:
        gw = _gateway()
        a, _ = gw.backends
        await gw.acquire(16, None, 0, "x")  # a is full
        request = _LeavesAsTheSlotFrees(gw, ticks)
        try:
            got = await _unless_client_leaves(request, gw.acquire(16, None, 0, "x"), 0.01)  # type: ignore[arg-type]
        except _ClientGoneError:
            got = None
        assert a.in_flight == (0 if got is None else 1)  # nobody holds a slot unknowingly
        assert not gw._queue

    asyncio.run(scenario())


def test_a_slot_comes_back_even_when_closing_the_upstream_is_cancelled() -> None:
    """The relay gave the slot back after awaiting the upstream close; a transport whose
    close yields (httpcore's does not) let the client's cancellation skip it."""

    async def scenario(app: Any, gw: Gateway) -> None:
        seen = await call(
            app, "POST", "/v1/completions", request_body(stream=True), leave_after_s=0.03
        )
        assert seen.left
        assert gw.backends[0].in_flight == 0
        assert outcome(gw, "client_gone") == 1

    slow = FakeBackend("b0", tokens=40, pieces=40, gap_s=0.01, shield_close=False)
    asyncio.run(with_fakes([slow], GatewayConfig(), scenario))


def test_a_probe_that_times_out_takes_a_backend_down_only_after_a_few_in_a_row() -> None:
    late = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            raise httpx.ConnectError("refused", request=request)
        if late["n"]:
            late["n"] -= 1
            raise httpx.ReadTimeout("busy", request=request)
        return httpx.Response(200, json={"status": "ok", "data": [{"id": "m"}]})

    async def scenario() -> None:
        gw = Gateway(["http://busy", "http://dead"])
        gw.client = _client(handler)
        busy, dead = gw.backends
        await gw.probe(busy)
        await gw.probe(dead)
        assert busy.up
        assert not dead.up  # a refused connection: down at once
        late["n"] = 2
        for _ in range(2):  # two late answers: still up (the default is 3 in a row)
            await gw.probe(busy)
            assert busy.up
        await gw.probe(busy)  # answered: the count starts again
        assert busy.probe_timeouts == 0
        late["n"] = 3
        for _ in range(3):
            await gw.probe(busy)
        assert not busy.up  # three in a row: down
        await gw.probe(busy)
        assert busy.up  # and a good probe brings it back

    asyncio.run(scenario())
