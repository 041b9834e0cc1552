"""The gateway under odd backends and clients, without subprocesses (mock transports).

Each test pins a bug an adversarial run found: head-of-line blocking across
models, requests for a down model waiting out the timeout, a health loop killed
by a malformed /v1/models, streamed answers read as ~30x slower than they were,
a timed-out stream retried and its backend marked down, huge integers as 500s.
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
    _ClientGoneError,
    _open_stream,
    _request_fields,
    _unless_client_leaves,
    model_ids,
    stream_tokens,
)
from duetime.server.load_workload import LoadWorkload


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
        gw.client = _client(handler)
        b = gw.backends[0]
        b.up = True
        b.in_flight = 1  # the slot _forward took
        with pytest.raises(ApiError) as info:
            await _open_stream(gw, b, "/v1/completions", b"{}", 16)
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
