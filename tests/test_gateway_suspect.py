"""A backend that answers /health but hangs on completions: suspect after N timeouts.

Such a backend stays "up" for the health probe; without a suspect state it would
take every request the healthy backends have no room for, each one hanging until
its timeout. ``suspect_after_timeouts`` read timeouts in a row eject it for
``suspect_cooldown_s`` while another backend can serve the request; then it
is on probation (one request at a time) until an answer arrives whole.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.server.gateway import Backend, GatewayConfig, create_gateway_app
from tests.gateway_choice import routed
from tests.gateway_fakes import MODEL, FakeBackend, FakeFleet, Seen, call
from tests.served import no_serving

BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 16}).encode()


def test_routing_passes_over_a_suspect_backend_until_it_answers() -> None:
    hung = Backend("http://a", up=True, timeouts=3, suspect_until=100.0)
    ok = Backend("http://b", up=True, in_flight=2, ttft_s=9.0)  # slow-looking and full
    assert routed([hung, ok], 16, max_inflight=2, mono=50.0) == (ok, False)  # wait for b
    ok.in_flight = 1
    assert routed([hung, ok], 16, max_inflight=2, mono=50.0) == (ok, True)
    # No other backend: better a suspect one than a 503.
    assert routed([hung], 16, max_inflight=2, mono=50.0) == (hung, True)
    ok.up = False
    assert routed([hung, ok], 16, max_inflight=2, mono=50.0) == (hung, True)
    # Cool-down over: on probation, one request at a time.
    ok.up, ok.in_flight = True, 2
    assert routed([hung, ok], 16, max_inflight=2, mono=100.0) == (hung, True)
    hung.in_flight = 1
    assert routed([hung, ok], 16, max_inflight=2, mono=100.0)[1] is False  # both full: wait


async def _until(cond: Any, limit_s: float = 20.0) -> None:
    """Wait for a state of the gateway or the fakes (generous: a busy machine is slow)."""
    for _ in range(int(limit_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the expected state never came")


def test_traffic_leaves_a_hanging_backend_and_comes_back_when_it_recovers() -> None:
    hanging = FakeBackend("b0", hang=True)  # /health is fine, completions hang
    healthy = FakeBackend("b1")
    config = GatewayConfig(
        max_inflight=2,
        request_timeout_s=0.5,  # how long each hang lasts
        suspect_after_timeouts=2,
        suspect_cooldown_s=600.0,  # ended by hand below, not by the clock
    )
    app = create_gateway_app(
        [b.url for b in (hanging, healthy)], config, transport=FakeFleet([hanging, healthy])
    )
    gw = app.state.gateway
    b0 = gw.backends[0]

    async def burst(n: int) -> list[asyncio.Task[Seen]]:
        tasks = [asyncio.create_task(call(app, "POST", "/v1/completions", BODY)) for _ in range(n)]
        await asyncio.sleep(0)
        return tasks

    async def scenario() -> None:
        # 1. Both look alike: b0 takes its share of a burst, and each of those hangs.
        healthy.gate = asyncio.Event()
        first = await burst(4)
        await _until(lambda: len(hanging.attempts) == 2 and len(healthy.attempts) == 2)
        await _until(lambda: b0.timeouts == 2)
        healthy.gate.set()
        seen = await asyncio.gather(*first)
        assert sorted(s.status for s in seen) == [200, 200, 504, 504]
        assert b0.suspect_until > 0
        health = (await call(app, "GET", "/health")).json()["backends"]
        assert [b["suspect"] for b in health] == [True, False]

        # 2. Suspect: a burst that overflows b1 waits for b1 instead of going to b0.
        healthy.gate = asyncio.Event()
        second = await burst(4)
        await _until(lambda: len(healthy.attempts) == 4 and len(gw._queue) == 2)
        assert len(hanging.attempts) == 2  # nothing new, though b0 has free slots
        healthy.gate.set()
        seen = await asyncio.gather(*second)
        assert [s.status for s in seen] == [200] * 4
        assert {s.headers["x-duetime-backend"] for s in seen} == {healthy.url}

        # 3. b0 recovers and its cool-down ends: on probation it gets one request,
        #    answers it, and is trusted again.
        hanging.hang = False
        b0.suspect_until = 1e-9  # the cool-down is over (without waiting 600 s)
        healthy.gate = asyncio.Event()
        third = await burst(4)
        await _until(lambda: len(hanging.attempts) >= 3)
        await _until(lambda: b0.suspect_until == 0.0)
        healthy.gate.set()
        seen = await asyncio.gather(*third)
        assert [s.status for s in seen] == [200] * 4
        assert hanging.url in {s.headers["x-duetime-backend"] for s in seen}
        assert b0.timeouts == 0
        metrics = (await call(app, "GET", "/metrics")).body.decode()
        assert f'duetime_gateway_backend_suspect{{backend="{hanging.url}"}} 0.0' in metrics

    async def run() -> None:
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(scenario(), 60.0)

    asyncio.run(run())


def test_cli_passes_the_suspect_options_to_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:

    from duetime.server import gateway as gateway_module

    seen: dict[str, Any] = {}
    real = gateway_module.create_gateway_app

    def capture(urls: Any, config: Any, *args: Any, **kw: Any) -> Any:
        seen["config"] = config
        return real(urls, config, *args, **kw)

    monkeypatch.setattr(gateway_module, "create_gateway_app", capture)
    no_serving(monkeypatch)
    args = ["gateway", "--backend", "http://127.0.0.1:9", "--port", "0"]
    r = CliRunner().invoke(cli_app, [*args, "--suspect-after", "5", "--suspect-cooldown", "2.5"])
    assert r.exit_code == 0, r.output
    assert seen["config"].suspect_after_timeouts == 5
    assert seen["config"].suspect_cooldown_s == 2.5
    r = CliRunner().invoke(cli_app, [*args, "--suspect-after", "-1"])
    assert r.exit_code == 2
