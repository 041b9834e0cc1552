"""What `duetime load` makes of outcomes and streams, without a server: deadline hits,
goodput and percentiles from hand-made outcomes; SSE lines, stream chunks and the
request body it sends.
"""

from __future__ import annotations

import pytest

from duetime.server.load_report import summarize_run, to_record
from duetime.server.load_workload import LoadRequest
from duetime.server.loadgen import (
    DONE,
    LoadRun,
    Outcome,
    Target,
    chunk_text,
    parse_sse_line,
    request_body,
)
from tests.load_fake_server import plan_requests

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


def test_errors_that_differ_only_by_a_number_count_as_one_kind() -> None:
    """Each too-long prompt's 400 named its own token count: five of them took all five
    places of top_errors and hid every other cause."""
    messages = [f"HTTP 400: prompt has {n} tokens, more than 2048" for n in range(3000, 3006)]
    messages += ["HTTP 500: engine failed", "HTTP 503: busy for 2.5 s", "HTTP 503: busy for 4 s"]
    outcomes = []
    for rid, message in enumerate(messages):
        o = _outcome(rid, "error", float(rid), None, deadline=9.0)
        o.error = message
        outcomes.append(o)
    row = summarize_run(LoadRun(outcomes, launch_s=1.0, wall_s=2.0))
    assert row["top_errors"] == {
        "HTTP 400: prompt has # tokens, more than #": 6,
        "HTTP 503: busy for # s": 2,
        "HTTP 500: engine failed": 1,
    }


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
    body = request_body(plan_requests(1)[0], Target(base="http://x", model="m"))
    assert set(body) == {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature"}


# --- found by tests/test_load_generator_properties.py ------------------------------------------


def test_an_empty_answer_has_a_ttft_and_leaves_the_percentiles_whole() -> None:
    """An ok answer without text (EOS first) had no first token: its TTFT was NaN, and with it
    every TTFT percentile of the run."""
    req = LoadRequest(0, 0.0, "p", 4, 8)
    spoken = Outcome(request=req, status="ok", sent=0.0, first_token=0.1, finish=0.3, chunks=3)
    silent = Outcome(request=LoadRequest(1, 0.0, "p", 4, 8), status="ok", sent=0.0, finish=0.2)
    row = summarize_run(LoadRun([spoken, silent], launch_s=0.0, wall_s=0.3))
    assert row["ttft_p50_s"] == pytest.approx(0.15)  # 0.1 and, for the silent one, 0.2
    assert to_record(silent).ttft == to_record(silent).e2e == pytest.approx(0.2)
