"""The gateway routes with the routers of ``core/router.py`` and reads deadlines in
every form clients send: body fields, ``x-deadline-ms``, llm-d's SLO headers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from duetime.core.router import FleetSnapshot, Refuse, Route, RouteDecision, Wait
from duetime.routers import available_routers, make_router
from duetime.server.errors import ApiError
from duetime.server.gateway import Ask, Backend, Gateway, GatewayConfig, create_gateway_app
from duetime.server.gateway_request import header_deadlines
from tests.factories import prometheus_samples
from tests.gateway_choice import estimate_rule, routed
from tests.gateway_fakes import MODEL, FakeBackend, FakeFleet, call


def _random_backends(rng: np.random.Generator, max_inflight: int) -> list[Backend]:
    out = []
    for i in range(int(rng.integers(1, 5))):
        b = Backend(f"http://b{i}", up=bool(rng.random() < 0.85))
        b.in_flight = int(rng.integers(0, max_inflight + 1))
        b.ttft_s = float(rng.choice([0.01, 0.05, 0.2]) * rng.uniform(0.5, 2))
        b.tpot_s = float(rng.choice([0.001, 0.01, 0.05]) * rng.uniform(0.5, 2))
        b.models = [] if rng.random() < 0.7 else [str(rng.choice(["m", "other"]))]
        b.suspect_until = float(rng.choice([0.0, 0.0, 0.0, 50.0, 200.0]))  # mono: 100
        out.append(b)
    return out


def test_the_forecast_router_chooses_as_the_estimate_rule() -> None:
    """On the same backend states, the forecast router on the gateway's snapshot picks
    what the estimate rule picks; where that rule found every backend full, the
    request waits for a slot on a backend the rule could use."""
    rng = np.random.default_rng(0)
    compared = waited = 0
    for _ in range(2000):
        max_inflight = int(rng.integers(1, 4))
        backends = _random_backends(rng, max_inflight)
        model = None if rng.random() < 0.5 else "m"
        max_tokens = int(rng.integers(1, 400))
        if not any(b.up and b.serves(model) for b in backends):
            continue
        ref = estimate_rule(backends, max_tokens, max_inflight, model, mono=100.0)
        got, free = routed(backends, max_tokens, max_inflight=max_inflight, mono=100.0, model=model)
        if ref is not None:
            assert (got, free) == (ref, True)
            compared += 1
        else:
            assert not free
            assert got.up
            assert got.serves(model)
            waited += 1
    assert compared > 500
    assert waited > 100


class _Recorder:
    """A router that answers as ``inner`` and keeps every snapshot and answer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[tuple[FleetSnapshot, RouteDecision]] = []

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        dec = self.inner.route(snap)
        self.seen.append((snap, dec))
        return dec


@pytest.mark.parametrize("name", available_routers())
def test_the_gateway_carries_out_its_routers_choice(name: str) -> None:
    """Each router, asked by the gateway, answers as a twin of it (same seed) does on
    the same snapshot, and the request goes where the answer says."""

    async def scenario() -> None:
        gw = Gateway([f"http://b{i}" for i in range(3)], GatewayConfig(max_inflight=2, router=name))
        rec = _Recorder(gw.router)
        gw.router = rec
        twin = make_router(name, seed=0)
        rng = np.random.default_rng(1)
        for b in gw.backends:
            b.up = True
            b.ttft_s, b.tpot_s = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.001, 0.02))
        pending: list[asyncio.Future] = []
        for k in range(40):
            if rng.random() < 0.4:  # a slot frees somewhere
                busy = [b for b in gw.backends if b.in_flight]
                if busy:
                    gw.release(busy[int(rng.integers(len(busy)))])
            ask = Ask(int(rng.integers(1, 200)), deadline_s=None, priority=int(rng.integers(2)))
            fut = asyncio.ensure_future(gw.admit(ask))
            await asyncio.sleep(0)
            snap, dec = rec.seen[-1]
            assert twin.route(snap) == dec, f"request {k}"
            assert isinstance(dec, Route)
            if fut.done():
                assert fut.result().backend is gw.backends[dec.replica]
            else:
                waiter = next(w for w in gw._queue if w.future is not None and w.seq == k)
                assert waiter.backend == dec.replica
                pending.append(fut)
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert not gw._queue

    asyncio.run(scenario())


class _Scripted:
    """A router that answers from a script, then routes to backend 0."""

    name = "scripted"

    def __init__(self, answers: list[RouteDecision]) -> None:
        self.answers = answers

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        return self.answers.pop(0) if self.answers else Route(0)


def test_wait_refuse_and_a_bad_route_are_carried_out_as_the_fleet_does() -> None:
    async def scenario() -> None:
        gw = Gateway(["http://a", "http://b"], GatewayConfig(max_inflight=1))
        a, b = gw.backends
        a.up = b.up = True
        gw.router = _Scripted([Wait(5.0), Route(0), Route(1)])
        waiting = asyncio.ensure_future(gw.admit(Ask(16)))
        await asyncio.sleep(0)
        assert [w.backend for w in gw._queue] == [None]  # the fleet queue
        assert (await gw.admit(Ask(16))).backend is a
        gw.release(a)  # a request ended: the fleet queue is offered again -> Route(1)
        assert (await asyncio.wait_for(waiting, 1.0)).backend is b
        gw.router = _Scripted([Refuse("too busy", retry_after_s=2.5)])
        with pytest.raises(ApiError) as info:
            await gw.admit(Ask(16))
        assert (info.value.status, info.value.code) == (429, "refused")
        assert info.value.headers == {"Retry-After": "3"}
        assert "too busy" in info.value.message
        gw.router = _Scripted([Route(1)])  # b is full, a has room: b is not offered
        with pytest.raises(ApiError) as info:
            await gw.admit(Ask(16))
        assert (info.value.status, info.value.code) == (500, "router_error")
        assert (a.in_flight, b.in_flight) == (0, 1)

    asyncio.run(scenario())


def test_a_request_waiting_for_a_backend_that_goes_down_is_routed_again() -> None:
    async def scenario() -> None:
        gw = Gateway(["http://a", "http://b"], GatewayConfig(max_inflight=1))
        a, b = gw.backends
        a.up = b.up = True
        b.ttft_s = 1.0  # a looks faster
        assert (await gw.admit(Ask(16))).backend is a
        assert (await gw.admit(Ask(16))).backend is b
        waiter = asyncio.ensure_future(gw.admit(Ask(16)))
        await asyncio.sleep(0)
        assert [w.backend for w in gw._queue] == [0]  # waits for a
        gw.mark(a, False)
        assert [w.backend for w in gw._queue] == [1]  # offered again: now waits for b
        gw.release(b)
        assert (await asyncio.wait_for(waiter, 1.0)).backend is b
        assert not gw._queue

    asyncio.run(scenario())


# --- deadlines from headers -----------------------------------------------------------
def test_deadline_headers_become_a_deadline_and_a_ttft_bound() -> None:
    assert header_deadlines({}, 100) == (None, None)
    assert header_deadlines({"x-deadline-ms": "2500"}, 100) == (2.5, None)
    # llm-d's pair: the first token within 200 ms, then 10 ms a token for 100 tokens
    both = {"x-slo-ttft-ms": "200", "x-slo-tpot-ms": "10"}
    assert header_deadlines(both, 100) == (pytest.approx(1.2), pytest.approx(0.2))
    assert header_deadlines({**both, "x-deadline-ms": "900"}, 100)[0] == pytest.approx(0.9)
    assert header_deadlines({"x-slo-ttft-ms": " 500 "}, 100) == (None, 0.5)
    assert header_deadlines({"x-slo-tpot-ms": "10"}, 100) == (None, None)  # a pace, no start


@pytest.mark.parametrize("header", ["x-deadline-ms", "x-slo-ttft-ms", "x-slo-tpot-ms"])
@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "1e12", ""])
def test_a_bad_deadline_header_is_a_400_that_names_it(header: str, value: str) -> None:
    backend = FakeBackend("b0")
    app = create_gateway_app([backend.url], GatewayConfig(), transport=FakeFleet([backend]))
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode()

    async def run() -> Any:
        async with app.router.lifespan_context(app):
            seen = await call(app, "POST", "/v1/completions", body, headers={header: value})
            metrics = (await call(app, "GET", "/metrics")).body.decode()
            return seen, metrics

    seen, metrics = asyncio.run(run())
    assert seen.status == 400
    err = seen.json()["error"]
    assert err["param"] == header
    assert header in err["message"]
    assert not backend.attempts  # nothing sent
    assert prometheus_samples(metrics)['duetime_gateway_requests_total{outcome="http_400"}'] == 1


def _over_two(**kw: Any) -> tuple[Any, list[FakeBackend]]:
    backends = [FakeBackend("b0"), FakeBackend("b1")]
    app = create_gateway_app(
        [b.url for b in backends], GatewayConfig(**kw), transport=FakeFleet(backends)
    )
    return app, backends


def test_slo_headers_are_admitted_refused_and_answered_with_the_forecast() -> None:
    app, backends = _over_two()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 16}).encode()

    async def run() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            post = lambda h: call(app, "POST", "/v1/completions", body, headers=h)  # noqa: E731
            return {
                # the estimates start at 50 ms to the first token, 20 ms a token (the
                # refusals come first: an answer teaches the estimates the fakes' speed)
                "ttft_fails": await post({"x-slo-ttft-ms": "10"}),
                "schedule_fails": await post({"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "1"}),
                "plain_fails": await post({"x-deadline-ms": "5"}),
                "ttft_ok": await post({"x-slo-ttft-ms": "500"}),
                "plain_ok": await post({"x-deadline-ms": "60000"}),
            }

    seen = asyncio.run(run())
    for key, code in [
        ("ttft_fails", "ttft_unreachable"),
        ("schedule_fails", "deadline_unreachable"),
        ("plain_fails", "deadline_unreachable"),
    ]:
        s = seen[key]
        assert s.status == 429, key
        assert int(s.headers["retry-after"]) >= 1
        err = s.json()["error"]
        assert err["code"] == code, key
        assert err["message"], key
    assert "x-slo-ttft-ms" in seen["ttft_fails"].json()["error"]["message"]
    assert sum(len(b.attempts) for b in backends) == 2  # the refused reached no backend
    for key in ("ttft_ok", "plain_ok"):
        s = seen[key]
        assert s.status == 200, key
        assert s.headers["x-duetime-backend"] in {b.url for b in backends}
        forecast = float(s.headers["x-duetime-forecast-ms"])
        first = float(s.headers["x-duetime-first-token-forecast-ms"])
        assert 0 < first <= forecast


def test_the_earliest_of_body_and_header_deadlines_counts() -> None:
    app, backends = _over_two()
    lax = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 16, "deadline_ms": 60000})

    async def run() -> Any:
        async with app.router.lifespan_context(app):
            return await call(
                app, "POST", "/v1/completions", lax.encode(), headers={"x-deadline-ms": "5"}
            )

    s = asyncio.run(run())
    assert s.status == 429
    assert s.json()["error"]["code"] == "deadline_unreachable"
    assert not any(b.attempts for b in backends)
