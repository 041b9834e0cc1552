"""`duetime load` against a fake OpenAI-compatible server: counts, timing, bounds, refusals.

The fake server (FastAPI + uvicorn on a free loopback port, in a background
thread) streams a few tokens with small sleeps. Its answers depend only on
the order requests reach it, so counts are exact whatever the timing:
every 5th request (n % 5 == 4) gets 429, every 7th (n % 7 == 6, if not 429)
gets 500. A request asking for >= 1000 tokens streams one token a second, so
the drain timeout has something to cut off.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from duetime.cli import app
from duetime.server.load_report import summarize_run, to_record
from duetime.server.load_target import TargetRefusedError, base_url, check_target, is_loopback
from duetime.server.load_workload import (
    LoadRequest,
    LoadWorkload,
    parse_class_values,
    parse_deadlines,
    parse_mix,
)
from duetime.server.loadgen import (
    DONE,
    Bounds,
    LoadRun,
    Outcome,
    Target,
    chunk_text,
    parse_sse_line,
    request_body,
    run_load,
)
from duetime.server.threaded import serve_in_thread

runner = CliRunner()
TOKEN_SLEEP_S = 0.004


class FakeServer:
    """Counts requests, keeps their bodies, answers as the module docstring says."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.slo_headers: list[str | None] = []  # each request's x-slo-ttft-ms
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.completions)

    def reset(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.slo_headers.clear()

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def completions(self, request: Request) -> Any:
        body = await request.json()
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(body)
            self.slo_headers.append(request.headers.get("x-slo-ttft-ms"))
        if n % 5 == 4:
            return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": "2"})
        if n % 7 == 6:
            return JSONResponse({"error": "boom"}, status_code=500)
        chat = "messages" in body
        tokens = min(int(body["max_tokens"]), 4)
        gap = 1.0 if body["max_tokens"] >= 1000 else TOKEN_SLEEP_S

        async def stream() -> AsyncIterator[str]:
            if chat:  # a role-only first chunk, as vLLM sends: not a token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(tokens):
                await asyncio.sleep(gap)
                part = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield _sse({"choices": [{"index": 0, **part}]})
            last: dict[str, Any] = {"choices": [], "usage": {"completion_tokens": tokens}}
            system = (chat and body["messages"][0]["role"] == "system") or (
                not chat and body["prompt"].startswith("SYS")
            )
            if system:  # a prefix cache served 8 of its 10 prompt tokens
                details = {"cached_tokens": 8}
                last["usage"].update(prompt_tokens=10, prompt_tokens_details=details)
            if "deadline_ms" in body:
                last["duetime"] = {"ttft_ms": 1.0, "e2e_ms": 20.0, "deadline_met": True}
            yield _sse(last)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeServer, str]]:
    server = FakeServer()
    with serve_in_thread(server.app, timeout_s=10) as url:
        yield server, url


@pytest.fixture
def server(fake: tuple[FakeServer, str]) -> tuple[FakeServer, str]:
    fake[0].reset()
    return fake


def _requests(n: int, *, gap: float = 0.002, max_tokens: int = 4, **kw: Any) -> list[LoadRequest]:
    return [
        LoadRequest(
            rid=i, arrival=i * gap, prompt=f"p{i}", prompt_len=4, max_tokens=max_tokens, **kw
        )
        for i in range(n)
    ]


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, ["load", *args])
    return res.exit_code, res.output


# --- the generator against the fake server ---------------------------------------------------


def test_counts_ok_rejected_errors_exactly(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    run = run_load(_requests(20), Target(base=url, model="m"), Bounds(max_requests=50))
    status = [o.status for o in run.outcomes]
    assert (status.count("ok"), status.count("rejected"), status.count("error")) == (14, 4, 2)
    assert len(fake.bodies) == 20
    rejected = [o for o in run.outcomes if o.status == "rejected"]
    assert all(o.retry_after_s == 2.0 and o.http_status == 429 for o in rejected)
    errors = [o for o in run.outcomes if o.status == "error"]
    assert all(o.error is not None and o.error.startswith("HTTP 500") for o in errors)
    for o in run.outcomes:
        if o.status == "ok":
            assert o.output_tokens == 4
            assert o.chunks == 4
            assert o.sent is not None
            assert o.first_token is not None
            assert o.finish is not None
            assert o.sent < o.first_token <= o.finish
            assert o.finish - o.sent >= 4 * TOKEN_SLEEP_S * 0.9


def test_summary_counts_percentiles_and_rates(server: tuple[FakeServer, str]) -> None:
    _, url = server
    run = run_load(_requests(20), Target(base=url, model="m"), Bounds())
    row = summarize_run(run)
    assert (row["sent"], row["ok"], row["rejected"], row["errors"], row["unfinished"]) == (
        20,
        14,
        4,
        2,
        0,
    )
    for name in ("ttft", "tbt", "e2e"):
        p50, p90, p99 = (row[f"{name}_p{q}_s"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, name
    assert row["ttft_p50_s"] <= row["e2e_p50_s"]
    assert row["output_tokens_total"] == 14 * 4
    assert row["throughput_tok_s"] > 0
    assert row["throughput_req_s"] > 0
    # No deadlines: goodput counts completed requests, and there is no hit rate.
    assert row["deadline_hit_rate"] is None
    assert row["goodput_req_s"] == pytest.approx(row["throughput_req_s"])
    assert row["top_errors"] == {'HTTP 500: {"error":"boom"}': 2}


def test_a_first_token_bound_is_sent_and_how_it_was_kept_is_reported(
    server: tuple[FakeServer, str],
) -> None:
    """Every request carries x-slo-ttft-ms; the report counts the answers whose first token
    came within the bound (all of them at 500 ms, none at 1 ms: the fake's first token
    takes 4 ms) and how fast the 429s came."""
    fake, url = server
    run = run_load(_requests(20), Target(base=url, model="m", slo_ttft_ms=500), Bounds())
    assert fake.slo_headers == ["500"] * 20
    kept = summarize_run(run, 0.5)
    assert kept["ttft_slo_met"] == 1.0
    assert kept["ttft_slo_refused"] == 4
    assert 0 < kept["ttft_slo_refusal_p50_s"] <= kept["ttft_slo_refusal_max_s"] < 0.5
    assert summarize_run(run, 0.001)["ttft_slo_met"] == 0.0
    assert "ttft_slo_met" not in summarize_run(run)


def test_wire_format_completions_and_chat(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    reqs = _requests(3, deadline_s=2.5, priority=3, klass="interactive")
    run = run_load(reqs, Target(base=url, model="m", ignore_eos=True), Bounds())
    body = fake.bodies[0]
    assert body["prompt"] == "p0"
    assert body["model"] == "m"
    assert body["max_tokens"] == 4
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert body["min_tokens"] == 4
    assert body["deadline_ms"] == 2500
    assert body["priority"] == 3
    assert body["temperature"] == 0
    assert run.outcomes[0].server == {"ttft_ms": 1.0, "e2e_ms": 20.0, "deadline_met": True}
    assert summarize_run(run)["server_deadline_met_rate"] == 1.0

    fake.reset()
    run = run_load(_requests(2), Target(base=url, model="m", chat=True), Bounds())
    body = fake.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "p0"}]
    assert "ignore_eos" not in body
    assert "min_tokens" not in body
    assert "deadline_ms" not in body
    assert [o.chunks for o in run.outcomes] == [4, 4]  # the role-only chunk is not a token


def test_a_system_prompt_begins_every_request_and_cached_tokens_are_reported(
    server: tuple[FakeServer, str],
) -> None:
    fake, url = server
    target = Target(base=url, model="m", chat=True, system_prompt="SYS: be brief. ")
    run = run_load(_requests(3), target, Bounds())
    assert fake.bodies[0]["messages"] == [
        {"role": "system", "content": "SYS: be brief. "},
        {"role": "user", "content": "p0"},
    ]
    ok = [o for o in run.outcomes if o.status == "ok"]
    assert ok
    assert all((o.prompt_tokens, o.cached_tokens) == (10, 8) for o in ok)
    assert summarize_run(run)["prompt_cached_pct"] == pytest.approx(80.0)

    fake.reset()
    plain = Target(base=url, model="m", system_prompt="SYS: be brief. ")
    run = run_load(_requests(2), plain, Bounds())
    assert fake.bodies[0]["prompt"] == "SYS: be brief. p0"
    fake.reset()
    run = run_load(_requests(2), Target(base=url, model="m"), Bounds())
    assert fake.bodies[0]["prompt"] == "p0"
    assert summarize_run(run)["prompt_cached_pct"] is None  # no server said


def test_bounded_by_max_requests_and_duration(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    run = run_load(_requests(50), Target(base=url, model="m"), Bounds(max_requests=5))
    assert len(run.outcomes) == 5
    assert len(fake.bodies) == 5

    fake.reset()
    reqs = _requests(1000, gap=0.01)  # 10 s of arrivals
    run = run_load(reqs, Target(base=url, model="m"), Bounds(max_requests=1000, duration_s=0.2))
    assert len(run.sent) == sum(r.arrival <= 0.2 for r in reqs) == 21  # none after 0.2 s
    assert run.launch_s < 1.0
    assert run.wall_s < 3.0
    assert summarize_run(run)["not_sent"] == 1000 - len(run.sent)


def test_drain_timeout_cancels_requests_in_flight(server: tuple[FakeServer, str]) -> None:
    _, url = server
    reqs = _requests(3, max_tokens=1000)  # one token a second on the fake server
    start = time.perf_counter()
    run = run_load(reqs, Target(base=url, model="m"), Bounds(drain_timeout_s=0.3))
    assert time.perf_counter() - start < 2.5  # 0.3 s drain, not 1000 s of tokens
    assert [o.status for o in run.outcomes] == ["unfinished"] * 3
    row = summarize_run(run)
    assert row["unfinished"] == 3
    assert row["ok"] == 0
    assert row["e2e_p50_s"] is None


def test_connection_refused_counts_as_errors() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = run_load(_requests(3), Target(base=f"http://127.0.0.1:{port}", model="m"), Bounds())
    assert [o.status for o in run.outcomes] == ["error"] * 3
    assert all(o.error and "Connect" in o.error for o in run.outcomes)


def test_request_timeout_is_an_error(server: tuple[FakeServer, str]) -> None:
    _, url = server
    bounds = Bounds(request_timeout_s=0.2, drain_timeout_s=5)
    run = run_load(_requests(1, max_tokens=1000), Target(base=url, model="m"), bounds)
    assert run.outcomes[0].status == "error"
    assert "timeout" in (run.outcomes[0].error or "")


# --- deadlines and goodput, from hand-made outcomes ------------------------------------------


def _outcome(rid: int, status: str, sent: float, finish: float | None, deadline: float) -> Outcome:
    req = LoadRequest(rid, sent, "p", 4, 8, klass="a" if rid % 2 else "b", deadline_s=deadline)
    o = Outcome(request=req, status=status, sent=sent, chunks=8)  # type: ignore[arg-type]
    if status == "ok":
        o.first_token, o.finish = sent + 0.1, finish
    else:
        o.ended = sent + 0.05
    return o


def test_deadline_hit_needs_success_within_the_deadline() -> None:
    outcomes = [
        _outcome(0, "ok", 0.0, 1.0, deadline=2.0),  # hit
        _outcome(1, "ok", 0.0, 3.0, deadline=2.0),  # late: miss
        _outcome(2, "rejected", 1.0, None, deadline=2.0),  # rejected: miss
        _outcome(3, "error", 2.0, None, deadline=9.0),  # failed: miss
        _outcome(4, "ok", 2.0, 4.0, deadline=2.0),  # e2e exactly 2.0: hit
    ]
    row = summarize_run(LoadRun(outcomes, launch_s=2.0, wall_s=4.0))
    assert row["deadline_requests"] == 5
    assert row["deadline_hit_rate"] == pytest.approx(2 / 5)
    assert row["span_s"] == pytest.approx(4.0)
    assert row["goodput_req_s"] == pytest.approx(2 / 4.0)
    assert row["throughput_req_s"] == pytest.approx(3 / 4.0)
    assert row["classes"]["b"]["deadline_hit_rate"] == pytest.approx(2 / 3)
    assert row["deadline_hit_rate[a]"] == 0.0
    assert to_record(outcomes[2]).cancelled_at == pytest.approx(1.05)


# --- parsing ---------------------------------------------------------------------------------


def test_sse_and_chunk_parsing() -> None:
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert parse_sse_line('data: {"choices": []}') == {"choices": []}
    with pytest.raises(ValueError, match="Expecting"):
        parse_sse_line("data: {not json")
    assert chunk_text({"choices": [{"text": "hi"}]}, chat=False) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}, chat=True) == "yo"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, chat=True) == ""
    assert chunk_text({"choices": [], "usage": {}}, chat=False) == ""


def test_request_body_leaves_extensions_out_unless_asked() -> None:
    body = request_body(_requests(1)[0], Target(base="http://x", model="m"))
    assert set(body) == {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature"}


def test_class_options_parse() -> None:
    assert parse_mix("interactive=1,batch=3") == {"interactive": 0.25, "batch": 0.75}
    assert parse_deadlines(["interactive=2.0", "batch=30"]) == {"interactive": 2.0, "batch": 30.0}
    assert parse_deadlines(["5"]) == {"*": 5.0}
    assert parse_class_values(["a=1,b=-2"], "--priority", int) == {"a": 1, "b": -2}
    for bad in ("interactive", "a=-1", "a=0,b=0"):
        with pytest.raises(ValueError, match="--class-mix"):
            parse_mix(bad)
    with pytest.raises(ValueError, match="--deadline"):
        parse_deadlines(["a=0"])


def test_workload_classes_deadlines_are_seeded() -> None:
    spec = LoadWorkload(
        workload="synthetic",
        requests=200,
        prompt_len=(8, 16),
        output_len=(4, 8),
        class_mix={"interactive": 0.3, "batch": 0.7},
        deadlines={"interactive": 2.0, "batch": 30.0},
        priorities={"interactive": 1},
    )
    a, b = spec.build(10.0), spec.build(10.0)
    assert a == b
    share = sum(r.klass == "interactive" for r in a) / len(a)
    assert 0.2 < share < 0.4
    for r in a:
        assert r.deadline_s == (2.0 if r.klass == "interactive" else 30.0)
        assert r.priority == (1 if r.klass == "interactive" else None)
        assert 4 <= r.max_tokens <= 8
        assert r.prompt.startswith(f"Request {r.rid}:")
    spec.deadlines = {"nosuch": 1.0}
    with pytest.raises(ValueError, match="nosuch"):
        spec.build(10.0)


def test_a_fixed_max_tokens_replaces_the_recorded_answer_length() -> None:
    """By default each ShareGPT request asks for its recorded answer's length (which
    tells the server how long it is); with ``fixed_max_tokens`` every one asks for
    the same limit, and prompts leave it room in the context."""
    plain = LoadWorkload(requests=50, max_tokens=256, max_context=600).build(5.0)
    assert len({r.max_tokens for r in plain}) > 10
    fixed = LoadWorkload(requests=50, max_tokens=256, max_context=600, fixed_max_tokens=400)
    reqs = fixed.build(5.0)
    assert len(reqs) == 50
    assert {r.max_tokens for r in reqs} == {400}
    assert max(r.prompt_len for r in reqs) <= 200
    for bad, why in ((600, "--max-context"), (0, "--max-context")):
        with pytest.raises(ValueError, match=why):
            LoadWorkload(requests=5, max_context=600, fixed_max_tokens=bad).build(5.0)
    with pytest.raises(ValueError, match="ShareGPT"):
        LoadWorkload(workload="synthetic", requests=5, fixed_max_tokens=64).build(5.0)


# --- the target check ------------------------------------------------------------------------


def test_loopback_targets_pass_and_remote_ones_are_refused() -> None:
    for url in (
        "http://127.0.0.1:8000",
        "http://localhost:8000/v1",
        "http://[::1]:9/",
        "http://127.9.9.9",
    ):
        check_target(url, allow_remote=False)
    assert base_url("http://localhost:8000/v1/") == "http://localhost:8000"
    with pytest.raises(TargetRefusedError, match="--allow-remote"):
        check_target("http://10.1.2.3:8000", allow_remote=False)
    assert check_target("http://10.1.2.3:8000", allow_remote=True) == "http://10.1.2.3:8000"
    assert is_loopback("0.0.0.0")  # connects to this host
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("::ffff:8.8.8.8")
    with pytest.raises(ValueError, match="--url"):
        base_url("ftp://127.0.0.1")
    # an httpx.InvalidURL traceback; a port no server has sent every request to an error
    for bad in ("http://[::1", "http://[::1]:abc", "http://127.0.0.1:8000:9", "http://h:99999"):
        with pytest.raises(ValueError, match=r"--url must be http://HOST:PORT"):
            base_url(bad)


# --- the command line ------------------------------------------------------------------------


def test_cli_refuses_remote_target_with_exit_2() -> None:
    code, output = _invoke("--url", "http://192.0.2.7:8000", "--workload", "synthetic")
    assert code == 2
    assert "--allow-remote" in output
    assert "192.0.2.7" in output
    assert "Traceback" not in output


def test_cli_bad_trace_exits_2_naming_line_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"rid": 0, "arrival": 0.0, "prompt_len": 10, "output_len": 5}\n'
        '{"rid": 1, "arrival": 0.5, "prompt_len": 0, "output_len": 5}\n'
    )
    code, output = _invoke("--workload", str(trace), "--model", "m")
    assert code == 2
    assert "bad.jsonl:2" in output
    assert "prompt_len" in output
    assert "Traceback" not in output


def test_cli_sweep_writes_json_rows_and_png(server: tuple[FakeServer, str], tmp_path: Path) -> None:
    _, url = server
    j, p = tmp_path / "load.json", tmp_path / "load.png"
    code, output = _invoke(
        "--url", url, "--workload", "synthetic", "--prompt-len", "8", "--output-len", "3-4",
        "--max-requests", "10", "--rate", "200,400", "--ignore-eos",
        "--class-mix", "interactive=0.5,batch=0.5", "--deadline", "interactive=2",
        "--deadline", "batch=30", "--priority", "interactive=1", "--slo-ttft-ms", "500",
        "--json", str(j), "--plot", str(p),
    )  # fmt: skip
    assert code == 0, output
    payload = json.loads(j.read_text())
    assert payload["config"]["slo_ttft_ms"] == 500
    assert all(r["ttft_slo_s"] == 0.5 and 0 <= r["ttft_slo_met"] <= 1 for r in payload["rows"])
    assert payload["config"]["model"] == "fake-model"  # discovered from /v1/models
    rows = payload["rows"]
    assert [r["rate_req_s"] for r in rows] == [200.0, 400.0]
    assert [r["run"] for r in rows] == ["200/s", "400/s"]
    for row in rows:
        assert row["sent"] == 10
        assert row["ok"] + row["rejected"] + row["errors"] == 10
        for key in ("ttft_p50_s", "tbt_p90_s", "e2e_p99_s", "throughput_tok_s", "goodput_req_s",
                    "deadline_hit_rate", "rejected", "errors"):  # fmt: skip
            assert key in row
        assert set(row["classes"]) == {"interactive", "batch"}
        assert 0.0 <= row["deadline_hit_rate"] <= 1.0
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "e2e_p90_s" in output
    assert "deadline_hit_rate" in output
    assert "ttft_slo_met" in output


def test_cli_trace_replay_one_rate_plots_cdf(
    server: tuple[FakeServer, str], tmp_path: Path
) -> None:
    fake, url = server
    trace, p = tmp_path / "t.jsonl", tmp_path / "cdf.png"
    lines = [
        {"rid": i, "arrival": i * 0.01, "prompt_len": 12, "output_len": 3,
         "deadline": i * 0.01 + 5.0, "klass": "robot", "priority": 2}
        for i in range(4)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, output = _invoke("--url", url, "--workload", str(trace), "--model", "m", "--plot", str(p))
    assert code == 0, output
    assert len(fake.bodies) == 4
    assert {b["deadline_ms"] for b in fake.bodies} == {5000.0}
    assert {b["priority"] for b in fake.bodies} == {2}
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_models_endpoint_that_is_not_there_is_one_line(server: tuple[FakeServer, str]) -> None:
    """A 404 from /v1/models: one line naming the URL and the status, no httpx docs link."""
    from duetime.server.load_target import discover_model

    _, url = server
    with pytest.raises(ValueError, match="cannot list models") as e:
        discover_model(f"{url}/nothing-here")
    assert "\n" not in str(e.value)
    assert "404" in str(e.value)


def test_cli_rate_inf_is_labelled_in_the_json(
    server: tuple[FakeServer, str], tmp_path: Path
) -> None:
    """Strict JSON writes an infinite rate as null, as for a trace: the label tells them apart."""
    _, url = server
    j = tmp_path / "load.json"
    code, output = _invoke(
        "--url", url, "--workload", "synthetic", "--prompt-len", "8", "--output-len", "3",
        "--max-requests", "4", "--rate", "inf", "--json", str(j),
    )  # fmt: skip
    assert code == 0, output
    (row,) = json.loads(j.read_text())["rows"]
    assert row["rate_req_s"] is None
    assert row["run"] == "inf/s"


def test_a_trace_sends_each_requests_overrun_and_eviction(tmp_path: Path) -> None:
    """The server takes both per request; a trace that sets them must have them sent."""
    from duetime.core.request import Job, Request
    from duetime.workloads import write_trace

    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        [
            Job(Request(rid=0, arrival=0.0, prompt_len=4, overrun="skip-next", kv_eviction=0.5), 2),
            Job(Request(rid=1, arrival=0.1, prompt_len=4, kv_eviction="auto"), 2),
            Job(Request(rid=2, arrival=0.2, prompt_len=4), 2),
        ],
    )
    reqs = LoadWorkload(workload=str(trace), requests=3).build(1.0)
    bodies = [request_body(r, Target(base="http://x", model="m")) for r in reqs]
    assert [(b.get("overrun"), b.get("kv_eviction")) for b in bodies] == [
        ("skip_next", 0.5),
        (None, "auto"),
        (None, None),
    ]


def test_a_lines_priority_0_is_sent_and_not_replaced_by_the_option(tmp_path: Path) -> None:
    """Request cannot tell priority 0 from none, so --priority overwrote a line's explicit 0."""
    line = {"rid": 0, "arrival": 0.0, "prompt_len": 4, "output_len": 2}
    trace = tmp_path / "t.jsonl"
    lines = [{**line, "priority": 0}, {**line, "rid": 1}, {**line, "rid": 2, "priority": 3}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = LoadWorkload(workload=str(trace), priorities={"*": 5}).build(1.0)
    assert [(r.rid, r.priority) for r in reqs] == [(0, 0), (1, 5), (2, 3)]
    body = request_body(reqs[0], Target(base="http://x", model="m"))
    assert body["priority"] == 0


# --- found by tests/test_load_and_trace_properties.py ------------------------------------------


def test_an_empty_answer_has_a_ttft_and_leaves_the_percentiles_whole() -> None:
    """An ok answer without text (EOS first) had no first token: its TTFT was NaN, and with it
    every TTFT percentile of the run."""
    req = LoadRequest(0, 0.0, "p", 4, 8)
    spoken = Outcome(request=req, status="ok", sent=0.0, first_token=0.1, finish=0.3, chunks=3)
    silent = Outcome(request=LoadRequest(1, 0.0, "p", 4, 8), status="ok", sent=0.0, finish=0.2)
    row = summarize_run(LoadRun([spoken, silent], launch_s=0.0, wall_s=0.3))
    assert row["ttft_p50_s"] == pytest.approx(0.15)  # 0.1 and, for the silent one, 0.2
    assert to_record(silent).ttft == to_record(silent).e2e == pytest.approx(0.2)


def _trace(tmp_path: Path, *lines: dict[str, Any]) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


LINE = {"rid": 0, "arrival": 0.0, "prompt_len": 4, "output_len": 2}


def test_a_trace_sends_each_requests_time_utility(tmp_path: Path) -> None:
    """duetime's server takes a TUF per request; a trace's TUFs were silently not sent."""
    tuf = {"ert": 1.5, "beta": 2.0, "alpha": -0.5}
    trace = _trace(tmp_path, {**LINE, "tuf": tuf}, {**LINE, "rid": 1})
    reqs = LoadWorkload(workload=trace).build(1.0)
    bodies = [request_body(r, Target(base="http://x", model="m")) for r in reqs]
    assert bodies[0]["tuf"] == {"ert_ms": 1500.0, "beta": 2.0, "alpha": -0.5}
    assert "tuf" not in bodies[1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (  # > 0, but sent as deadline_ms 0.0, which the server refuses: every request a 400
            {**LINE, "arrival": 1.0, "deadline": 1.0000001},
            r"t\.jsonl:2: field 'deadline': deadline - arrival = 1e-07 s, sent as deadline_ms 0;",
        ),
        (  # said "trace request 7", not which file or line
            {**LINE, "rid": 7, "arrival": 1.0, "deadline": 1.0},
            r"t\.jsonl:2: field 'deadline': deadline - arrival = 0 s",
        ),
        (
            {**LINE, "arrival": 1.0, "prompt_len": 2047},
            r"t\.jsonl:2: field 'prompt_len': prompt_len \+ output_len = 2049 exceeds",
        ),
        (
            {**LINE, "tuf": {"ert": 1.0, "beta": -1.0}},
            r"t\.jsonl:2: field 'tuf': beta -1\.0 is refused by the server",
        ),
    ],
)
def test_a_trace_request_that_cannot_be_sent_names_file_line_and_field(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    trace = _trace(tmp_path, {**LINE, "rid": 99}, line)
    with pytest.raises(ValueError, match=message):
        LoadWorkload(workload=trace).build(1.0)


def test_a_deadline_option_that_would_be_sent_as_0_ms_is_refused() -> None:
    with pytest.raises(ValueError, match="--deadline for '\\*' must be a number of seconds > 0"):
        parse_deadlines(["1e-7"])
    with pytest.raises(ValueError, match="<= 1e\\+06"):
        parse_deadlines(["2e6"])
