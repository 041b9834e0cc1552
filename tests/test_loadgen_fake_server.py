"""`duetime load` against the fake OpenAI-compatible server: counts, timing, bounds, the
wire format, and whole command-line runs (sweeps, trace replays, model discovery).

The fake server (tests/load_fake_server.py) answers 429 to every 5th request and 500
to every 7th, whatever the timing, and streams one token a second when asked for
>= 1000 tokens. It is a module-scoped fixture: every test that needs it lives here.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duetime.server.load_report import summarize_run
from duetime.server.loadgen import Bounds, Target, run_load
from duetime.server.threaded import serve_in_thread
from tests.load_fake_server import TOKEN_SLEEP_S, FakeServer, invoke_load, plan_requests


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeServer, str]]:
    server = FakeServer()
    with serve_in_thread(server.app, timeout_s=10) as url:
        yield server, url


@pytest.fixture
def server(fake: tuple[FakeServer, str]) -> tuple[FakeServer, str]:
    fake[0].reset()
    return fake


# --- the generator against the fake server ---------------------------------------------------


def test_counts_ok_rejected_errors_exactly(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    run = run_load(plan_requests(20), Target(base=url, model="m"), Bounds(max_requests=50))
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
    run = run_load(plan_requests(20), Target(base=url, model="m"), Bounds())
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
    run = run_load(plan_requests(20), Target(base=url, model="m", slo_ttft_ms=500), Bounds())
    assert fake.slo_headers == ["500"] * 20
    kept = summarize_run(run, 0.5)
    assert kept["ttft_slo_met_rate"] == 1.0
    assert kept["ttft_slo_refused"] == 4
    assert 0 < kept["ttft_slo_refusal_p50_s"] <= kept["ttft_slo_refusal_max_s"] < 0.5
    assert summarize_run(run, 0.001)["ttft_slo_met_rate"] == 0.0
    assert "ttft_slo_met_rate" not in summarize_run(run)


def test_wire_format_completions_and_chat(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    reqs = plan_requests(3, deadline_s=2.5, priority=3, klass="interactive")
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
    run = run_load(plan_requests(2), Target(base=url, model="m", chat=True), Bounds())
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
    run = run_load(plan_requests(3), target, Bounds())
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
    run = run_load(plan_requests(2), plain, Bounds())
    assert fake.bodies[0]["prompt"] == "SYS: be brief. p0"
    fake.reset()
    run = run_load(plan_requests(2), Target(base=url, model="m"), Bounds())
    assert fake.bodies[0]["prompt"] == "p0"
    assert summarize_run(run)["prompt_cached_pct"] is None  # no server said


def test_bounded_by_max_requests_and_duration(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    run = run_load(plan_requests(50), Target(base=url, model="m"), Bounds(max_requests=5))
    assert len(run.outcomes) == 5
    assert len(fake.bodies) == 5

    fake.reset()
    reqs = plan_requests(1000, gap=0.01)  # 10 s of arrivals
    run = run_load(reqs, Target(base=url, model="m"), Bounds(max_requests=1000, duration_s=0.2))
    assert len(run.sent) == sum(r.arrival <= 0.2 for r in reqs) == 21  # none after 0.2 s
    assert run.launch_s < 1.0
    assert run.wall_s < 3.0
    assert summarize_run(run)["not_sent"] == 1000 - len(run.sent)


def test_drain_timeout_cancels_requests_in_flight(server: tuple[FakeServer, str]) -> None:
    _, url = server
    reqs = plan_requests(3, max_tokens=1000)  # one token a second on the fake server
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
    run = run_load(plan_requests(3), Target(base=f"http://127.0.0.1:{port}", model="m"), Bounds())
    assert [o.status for o in run.outcomes] == ["error"] * 3
    assert all(o.error and "Connect" in o.error for o in run.outcomes)


def test_request_timeout_is_an_error(server: tuple[FakeServer, str]) -> None:
    _, url = server
    bounds = Bounds(request_timeout_s=0.2, drain_timeout_s=5)
    run = run_load(plan_requests(1, max_tokens=1000), Target(base=url, model="m"), bounds)
    assert run.outcomes[0].status == "error"
    assert "timeout" in (run.outcomes[0].error or "")


# --- the command line ------------------------------------------------------------------------


def test_cli_sweep_writes_json_rows_and_png(server: tuple[FakeServer, str], tmp_path: Path) -> None:
    _, url = server
    j, p = tmp_path / "load.json", tmp_path / "load.png"
    code, output = invoke_load(
        "--url", url, "--workload", "synthetic", "--prompt-len", "8", "--output-len", "3-4",
        "--max-requests", "10", "--rate", "200,400", "--ignore-eos",
        "--class-mix", "interactive=0.5,batch=0.5", "--deadline", "interactive=2",
        "--deadline", "batch=30", "--priority", "interactive=1", "--slo-ttft-ms", "500",
        "--json", str(j), "--plot", str(p),
    )  # fmt: skip
    assert code == 0, output
    payload = json.loads(j.read_text())
    assert payload["config"]["slo_ttft_ms"] == 500
    assert all(r["ttft_slo_s"] == 0.5 and 0 <= r["ttft_slo_met_rate"] <= 1 for r in payload["rows"])
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
    assert "ttft_slo_met_rate" in output


def test_each_rate_of_a_sweep_sends_prompts_of_its_own(server: tuple[FakeServer, str]) -> None:
    """The same prompts at the next rate would be served from the prefix cache the run
    before filled: ShareGPT prompts at 1 then 2 requests/s showed 0 % then 87 % cached.
    The sweep's first run is the single-rate run's."""
    fake, url = server
    args = ("--url", url, "--workload", "synthetic", "--prompt-len", "32", "--output-len", "2",
            "--max-requests", "6")  # fmt: skip
    code, output = invoke_load(*args, "--rate", "400,800")
    assert code == 0, output
    prompts = [b["prompt"] for b in fake.bodies]
    first, second = set(prompts[:6]), set(prompts[6:])
    assert len(prompts) == 12
    assert not first & second
    fake.reset()
    code, output = invoke_load(*args, "--rate", "400")
    assert code == 0, output
    assert {b["prompt"] for b in fake.bodies} == first


def test_the_servers_context_bounds_the_requests_unless_one_is_given(
    server: tuple[FakeServer, str], tmp_path: Path
) -> None:
    """--max-context defaulted to 2,048 tokens beside a server of 1,024: most of a
    ShareGPT load was refused with HTTP 400. The server's max_model_len now bounds it."""
    fake, url = server
    fake.max_model_len = 300
    path = tmp_path / "load.json"
    args = ["--url", url, "--max-requests", "3", "--rate", "400", "--json", str(path)]
    code, output = invoke_load(*args)
    assert code == 0, output
    assert "--max-context 300: fake-model's max_model_len" in output
    assert json.loads(path.read_text())["config"]["max_context_tokens"] == 300
    code, output = invoke_load(*args, "--max-context", "1000")  # given: kept
    assert code == 0, output
    assert json.loads(path.read_text())["config"]["max_context_tokens"] == 1000


def test_a_model_the_server_does_not_list_is_refused_before_any_request(
    server: tuple[FakeServer, str],
) -> None:
    """`--model nosuch` ran in full, every request a 404, and exited 0."""
    fake, url = server
    code, output = invoke_load("--url", url, "--model", "nosuch", "--max-requests", "3")
    assert code == 2, output
    assert "--model 'nosuch'" in output
    assert "fake-model" in output
    assert not fake.bodies


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
    j = tmp_path / "t.json"
    code, output = invoke_load(
        "--url", url, "--workload", str(trace), "--model", "fake-model", "--plot", str(p),
        "--json", str(j),
    )  # fmt: skip
    assert code == 0, output
    config = json.loads(j.read_text())["config"]
    assert [config[k] for k in ("arrival", "cv", "burst_size")] == [None] * 3  # the trace's own
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
    code, output = invoke_load(
        "--url", url, "--workload", "synthetic", "--prompt-len", "8", "--output-len", "3",
        "--max-requests", "4", "--rate", "inf", "--json", str(j),
    )  # fmt: skip
    assert code == 0, output
    (row,) = json.loads(j.read_text())["rows"]
    assert row["rate_req_s"] is None
    assert row["run"] == "inf/s"
