"""`duetime gateway` over two `duetime serve` subprocesses: routing, pass-through, failover."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.core.cost import LinearStepCost
from duetime.core.router import Route
from duetime.routers import make_router
from duetime.server.gateway import Ask, Backend, GatewayConfig, create_gateway_app
from duetime.server.threaded import serve_in_thread
from tests.backend_procs import DUETIME, start_backend, wait_healthy
from tests.factories import prometheus_samples
from tests.gateway_choice import offer, routed

MODEL = "duetime-tiny"


def test_routing_picks_earliest_predicted_finish() -> None:
    # with a slot free the request joins the backend's batch now: its own time decides
    fast = Backend("http://a", up=True, in_flight=3, ttft_s=0.01, tpot_s=0.001)  # 0.11 s
    slow = Backend("http://b", up=True, in_flight=0, ttft_s=0.05, tpot_s=0.01)  # 1.05 s
    assert routed([fast, slow], 100, max_inflight=8, mono=0.0) == (fast, True)
    slow.tpot_s = 0.0005  # 0.10 s < 0.11 s
    assert routed([fast, slow], 100, max_inflight=8, mono=0.0) == (slow, True)
    slow.up = False
    assert routed([fast, slow], 100, max_inflight=8, mono=0.0) == (fast, True)
    fast.in_flight = 8  # at its cap: the request waits for a slot there
    assert routed([fast, slow], 100, max_inflight=8, mono=0.0) == (fast, False)
    slow.up, slow.models = True, ["other-model"]
    assert routed([fast, slow], 100, max_inflight=8, mono=0.0, model=MODEL) == (fast, False)


def test_a_batching_backend_is_forecast_as_a_batch_not_one_request_at_a_time() -> None:
    """Answers seen at 2.4 s each on a backend running 3 of its 8 slots: a new request
    joins the batch and ends in ~2.4 s (a 7 s deadline is met), not after the three
    ahead of it one by one (9.6 s); past the 8 slots it waits ~2.4 / 8 s a request
    ahead of it for one to free."""
    b = Backend("http://a", up=True, in_flight=3, ttft_s=0.4, tpot_s=0.03125, observed=5)
    ask = Ask(64, deadline_s=7.0, prompt_len=128)
    got = offer([b], ask, max_inflight=8)
    assert got.finish[0] == pytest.approx(2.4)
    assert got.first[0] == pytest.approx(0.4)
    assert isinstance(make_router("forecast").route(got.snap), Route)
    b.in_flight = 12  # 5 past the 8 slots, this one included
    got = offer([b], ask, max_inflight=8)
    assert got.finish[0] == pytest.approx(2.4 + 5 * 2.4 / 8)
    assert got.first[0] == pytest.approx(0.4 + 5 * 2.4 / 8)


def test_a_published_cost_model_prices_the_batch_the_request_joins() -> None:
    """Before any answer, both backends price the request with the same published model
    at one sequence; on the busier one its decode steps are slower by the model's step
    at the larger batch."""
    cost = LinearStepCost.batch(c=0.010, a=0.0005, b=0.004, d=0.0)
    idle = Backend("http://a", up=True, in_flight=0)
    busy = Backend("http://b", up=True, in_flight=4)
    for b in (idle, busy):
        b.published.cost = cost
    ask = Ask(32, prompt_len=16)
    got = offer([busy, idle], ask, max_inflight=8)
    prefill, decode = cost.prefill_time(16), cost.decode_span(31, 1, 16)
    assert got.finish[1] == pytest.approx(prefill + decode)
    assert got.finish[0] == pytest.approx(prefill + decode * (0.010 + 5 * 0.004) / 0.014)
    dec = make_router("forecast").route(got.snap)
    assert isinstance(dec, Route)
    assert dec.replica == 1


def test_answers_seen_at_a_batch_price_a_larger_one_slower() -> None:
    """An answer that ended beside another (2 in flight) ran at the published model's
    2-sequence step: its pace is kept for one sequence alone, and a request joining 6
    others decodes at the model's 7-sequence step, on an idle backend at one."""
    cost = LinearStepCost.batch(c=0.010, a=0.0005, b=0.004, d=0.0)
    s1, s2, s7 = (0.010 + k * 0.004 for k in (1, 2, 7))
    b = Backend("http://a", up=True, in_flight=2)
    b.published.cost = cost
    b.observe(0.2, 2.2, 65, alpha=0.5)  # ttft 0.2 s, then 2 s over 64 tokens
    assert b.tpot_s == pytest.approx(2.0 / 64 * s1 / s2)
    b.in_flight = 6
    got = offer([b], Ask(64, prompt_len=16), max_inflight=8)
    assert got.finish[0] == pytest.approx(0.2 + 64 * b.tpot_s * s7 / s1)
    b.in_flight = 0
    got = offer([b], Ask(64, prompt_len=16), max_inflight=8)
    assert got.finish[0] == pytest.approx(0.2 + 64 * b.tpot_s)


def test_ewma_learns_from_answers() -> None:
    b = Backend("http://a")
    b.observe(0.1, 1.1, 11, alpha=0.5)
    assert b.ttft_s == pytest.approx(0.1)
    assert b.tpot_s == pytest.approx(0.1)
    b.observe(0.3, 0.3 + 10 * 0.3, 11, alpha=0.5)
    assert b.ttft_s == pytest.approx(0.2)
    assert b.tpot_s == pytest.approx(0.2)


def test_cli_refuses_bad_backends() -> None:
    runner = CliRunner()
    r = runner.invoke(cli_app, ["gateway"])
    assert r.exit_code == 2
    assert "--backend" in r.output
    r = runner.invoke(cli_app, ["gateway", "--backend", "http://10.1.2.3:8000"])
    assert r.exit_code == 2
    assert "--allow-remote" in r.output
    r = runner.invoke(cli_app, ["gateway", "--backend", "ftp://127.0.0.1:1"])
    assert r.exit_code == 2
    # an InvalidURL traceback, and a port no server can have that the gateway took
    for bad in ("http://[::1", "http://127.0.0.1:99999"):
        r = runner.invoke(cli_app, ["gateway", "--backend", bad])
        assert r.exit_code == 2, r.output
        assert f"--backend must be http://HOST:PORT or https://HOST:PORT, got '{bad}'" in r.output
    r = runner.invoke(cli_app, ["gateway", "--backend", "http://127.0.0.1:1", "--seed", "-1"])
    assert r.exit_code == 2  # "expected non-negative integer" named no option
    assert "--seed must be >= 0, got -1" in r.output


@pytest.mark.parametrize(
    ("host", "backend"),
    [
        ("127.0.0.1", "http://127.0.0.1:18731"),
        ("0.0.0.0", "http://localhost:18731"),  # a wildcard address listens on loopback too
        ("localhost", "http://127.0.0.1:18731"),
    ],
)
def test_cli_refuses_its_own_address_as_a_backend(host: str, backend: str) -> None:
    """It routed requests to itself (4 requests counted ok 7 times)."""
    from tests.factories import cli_refused

    other = "http://127.0.0.1:18732"
    cli_refused(
        *("gateway", "--host", host, "--port", "18731", "--backend", other, "--backend", backend),
        names="is this gateway's own address",
    )


def test_cli_takes_a_backend_on_its_port_at_another_host() -> None:
    from duetime.cli.gateway import _check_not_itself

    _check_not_itself(["http://127.0.0.1:8000"], "10.0.0.5", 8000)  # not itself
    _check_not_itself(["http://127.0.0.1:8001"], "127.0.0.1", 8000)
    _check_not_itself(["http://127.0.0.1:8000"], "127.0.0.1", 0)  # any free port


# --- end to end --------------------------------------------------------------------------


@contextmanager
def _fleet(router: str) -> Iterator[tuple[list[subprocess.Popen], list[str], str]]:
    """Two `duetime serve` backends behind a gateway routing with ``router``."""
    if not DUETIME.exists():
        pytest.skip("the duetime console script is not installed next to the interpreter")
    started = [start_backend(), start_backend()]
    procs = [p for p, _ in started]
    urls = [u for _, u in started]
    try:
        for p, u in started:
            wait_healthy(p, u)
        config = GatewayConfig(
            max_inflight=3, health_interval_s=0.2, request_timeout_s=60.0, router=router
        )
        with serve_in_thread(create_gateway_app(urls, config)) as gw:
            yield procs, urls, gw
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[subprocess.Popen], list[str], str]]:
    with _fleet("forecast") as f:
        yield f


def _parse_sse(text: str) -> list[object]:
    events: list[object] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block.startswith("data: "):
            continue
        data = block[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


async def _one(client: httpx.AsyncClient, gw: str, i: int, max_tokens: int) -> dict:
    prompt = f"request number {i} says"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "echo": True,
        "stream": i % 3 == 0,
    }
    out: dict = {"i": i, "prompt": prompt, "stream": body["stream"]}
    r = await client.post(gw + "/v1/completions", json=body)
    out["status"] = r.status_code
    out["backend"] = r.headers.get("x-duetime-backend")
    if body["stream"] and r.status_code == 200:
        out["events"] = _parse_sse(r.text)
    else:
        out["json"] = r.json()
    return out


def _check_answer(res: dict, max_tokens: int) -> str:
    """'ok' for a complete answer to this very prompt, 'failed' for a clear error."""
    if not res["stream"]:
        if res["status"] == 200:
            choice = res["json"]["choices"][0]
            assert choice["text"].startswith(res["prompt"]), "an answer to another request"
            assert res["json"]["usage"]["completion_tokens"] == max_tokens
            return "ok"
        assert res["status"] in (502, 503), res
        assert "error" in res["json"]
        return "failed"
    assert res["status"] == 200, res  # a stream may fail under way, not be refused
    events = res["events"]
    assert events.count("[DONE]") == 1, events[-3:]
    assert events[-1] == "[DONE]"
    dicts = [e for e in events if isinstance(e, dict)]
    errors = [e for e in dicts if "error" in e]
    finals = [e for e in dicts if "choices" in e and e["choices"][0]["finish_reason"]]
    assert len(errors) + len(finals) == 1, "exactly one ending per stream"
    assert dicts[0]["choices"][0]["text"] == res["prompt"]  # the echo: this request's answer
    if errors:
        assert errors[0]["error"]["backend"] == res["backend"]
        assert "failed mid-stream" in errors[0]["error"]["message"]
        return "failed"
    text = "".join(e["choices"][0]["text"] for e in dicts if "choices" in e)
    assert text.startswith(res["prompt"])
    assert len(text) > len(res["prompt"])
    assert finals[0]["choices"][0]["finish_reason"] == "length"
    return "ok"


def test_burst_survives_a_backend_killed_midway(
    fleet: tuple[list[subprocess.Popen], list[str], str],
) -> None:
    _kill_one_midway(*fleet)


def test_burst_survives_a_backend_killed_midway_under_lor() -> None:
    """The same with a router of the simulated fleet: least outstanding requests."""
    with _fleet("lor") as (procs, urls, gw):
        _kill_one_midway(procs, urls, gw)
        assert httpx.get(gw + "/health", trust_env=False).json()["router"] == "lor"


def _kill_one_midway(procs: list[subprocess.Popen], urls: list[str], gw: str) -> None:
    """A burst of 24; backend 0 killed once busy: each request answered exactly once."""
    n, max_tokens = 24, 40

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, trust_env=False, limits=limits) as client:
            tasks = [asyncio.create_task(_one(client, gw, i, max_tokens)) for i in range(n)]
            # Kill backend 0 once it is busy and some answers have come back.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                h = (await client.get(gw + "/health")).json()
                done = sum(t.done() for t in tasks)
                if done >= 3 and h["backends"][0]["in_flight"] > 0:
                    break
                await asyncio.sleep(0.01)
            procs[0].kill()
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert sorted(r["i"] for r in results) == list(range(n))  # none lost, none twice
    verdicts = [_check_answer(r, max_tokens) for r in results]
    # Whole answers were retried on the survivor; only streams already under way may fail.
    for r, v in zip(results, verdicts, strict=True):
        if v == "failed":
            assert r["stream"], r
            assert r["backend"] == urls[0]
    assert verdicts.count("ok") >= n - sum(r["stream"] for r in results)

    # The dead backend is out of rotation, and everything now lands on the survivor.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        h = httpx.get(gw + "/health", trust_env=False).json()
        if not h["backends"][0]["up"]:
            break
        time.sleep(0.05)
    assert h["backends"][0]["up"] is False
    assert h["backends"][1]["up"] is True
    metrics = httpx.get(gw + "/metrics", trust_env=False).text
    assert f'duetime_gateway_backend_up{{backend="{urls[0]}"}} 0.0' in metrics
    assert f'duetime_gateway_backend_up{{backend="{urls[1]}"}} 1.0' in metrics
    counts = prometheus_samples(metrics)
    outcomes = {k: v for k, v in counts.items() if k.startswith("duetime_gateway_requests_total")}
    assert sum(outcomes.values()) == n  # one outcome per request: none lost, none counted twice
    failed = counts.get('duetime_gateway_requests_total{outcome="failed_midstream"}', 0)
    assert counts["duetime_gateway_retries_total"] + failed >= 1  # the kill hit requests in flight

    async def after() -> list[dict]:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            return await asyncio.gather(*(_one(client, gw, n + i, 8) for i in range(6)))

    later = asyncio.run(after())
    assert all(_check_answer(r, 8) == "ok" for r in later)
    assert {r["backend"] for r in later} == {urls[1]}


def test_unreachable_deadline_and_models(
    fleet: tuple[list[subprocess.Popen], list[str], str],
) -> None:
    _, _, gw = fleet
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "deadline_ms": 0.5}
    r = httpx.post(gw + "/v1/completions", json=body, trust_env=False)
    assert r.status_code == 429
    assert "Retry-After" in r.headers
    assert r.json()["error"]["code"] == "deadline_unreachable"
    models = httpx.get(gw + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    r = httpx.post(gw + "/v1/completions", json={**body, "model": "nope"}, trust_env=False)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    # a trailing slash reaches the route (was a bare 307), on the gateway as on a backend
    r = httpx.post(gw + "/v1/completions/", json={**body, "deadline_ms": None}, trust_env=False)
    assert r.status_code == 200, r.text


def test_lor_routes_by_the_backends_own_metrics() -> None:
    """Backend 0 is kept busy by a client that bypasses the gateway: only its own /metrics
    tells the gateway so (by the gateway's counts alone the two tie, and backend 0 wins)."""
    with _fleet("lor") as (_, urls, gw):
        long = {"model": MODEL, "prompt": "busy", "max_tokens": 400, "ignore_eos": True}

        async def keep_busy(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
            """Posts long requests to backend 0 back to back until ``stop``: the backend
            stays at work however fast this machine decodes them."""
            while not stop.is_set():
                r = await client.post(urls[0] + "/v1/completions", json=long)
                assert r.status_code == 200, r.text

        async def run() -> tuple[dict, list[str | None]]:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
                stop = asyncio.Event()
                direct = [asyncio.create_task(keep_busy(client, stop)) for _ in range(4)]
                health: dict = {}
                waited = time.monotonic() + 30.0
                while time.monotonic() < waited:  # until a scrape shows backend 0 at work
                    health = (await client.get(gw + "/health")).json()
                    m = health["backends"][0]["metrics"]
                    if not m["stale"] and m["running"] + m["waiting"] >= 2 and m["kv_used"] > 0:
                        break
                    await asyncio.sleep(0.05)
                to = []
                for _ in range(3):
                    r = await client.post(gw + "/v1/completions", json={**long, "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    to.append(r.headers.get("x-duetime-backend"))
                stop.set()
                await asyncio.gather(*direct)
                return health, to

        health, to = asyncio.run(run())
        busy, idle = (b["metrics"] for b in health["backends"])
        assert busy["kind"] == idle["kind"] == "duetime"
        assert busy["running"] + busy["waiting"] >= 2, busy
        assert busy["kv_used"] > 0
        assert busy["kv_capacity"] > 0
        assert to == [urls[1]] * 3
