"""Properties of `duetime load`, drawn by hypothesis, against a scripted server.

The load generator runs against a fake OpenAI-compatible server whose answer
to each request is drawn (tests/load_scripted_server.py): streamed or whole,
slow or fast, HTTP errors, 429s, redirects, error events, malformed or cut-off
streams, empty answers, odd ``usage``. Every request is counted once, in the
state its answer calls for, with the tokens the fake sent; percentiles are
ordered and TTFT <= e2e; the JSON report is strict JSON with unit-named keys;
and every body the fake receives carries the trace's per-request fields and is
one duetime's own server accepts. What the properties found is kept at the end
as plain regressions.

The scripted server is a module-scoped fixture: every test that needs it lives here.
``DUETIME_FUZZ_EXAMPLES=N`` deepens the search (see tests/trace_strategies.py): each
test here runs N/25 times its own default number of examples (``=500``: twenty times).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from typer.testing import CliRunner

from duetime.cli import app
from duetime.core.request import TimeUtility
from duetime.metrics import write_json
from duetime.server.load_report import summarize_run, to_record
from duetime.server.load_workload import LoadRequest
from duetime.server.loadgen import Bounds, Target, run_load
from duetime.server.threaded import serve_in_thread
from duetime.workloads.trace import job_to_dict
from tests.load_scripted_server import Answer, ScriptedServer, answers
from tests.trace_strategies import TUFS, fuzz_settings, trace_jobs

runner = CliRunner()


# --- 3. the load generator against a fake server -----------------------------------------------


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedServer, str]]:
    server = ScriptedServer()
    with serve_in_thread(server.app, log_level="critical") as url:
        yield server, url


#: Keys of a report row that are counts, fractions or labels; every other key names its unit.
UNITLESS = {
    "sent", "ok", "rejected", "errors", "unfinished", "not_sent", "deadline_requests",
    "server_reports", "output_tokens_total", "ok_rate", "deadline_hit_rate",
    "server_deadline_met_rate", "server_kv_eviction_ratio_mean", "top_errors", "classes",
    "run",
}  # fmt: skip


def _check_row(row: dict[str, Any], records: list[Any] | None = None) -> None:
    """Counts add up; percentiles ordered, >= 0 and (given the records) <= the largest
    value; TTFT percentiles <= e2e ones; every key names its unit."""
    assert row["ok"] + row["rejected"] + row["errors"] + row["unfinished"] == row["sent"]
    for key in row:
        base = key.split("[", 1)[0]
        assert base in UNITLESS or base.endswith(("_s", "_pct")), key
    for name in ("ttft", "tbt", "e2e"):
        values = [row[f"{name}_p{q}_s"] for q in (50, 90, 99)]
        if row["ok"] == 0 or (name == "tbt" and values[0] is None):
            assert values == [None] * 3, (name, values)
            continue
        assert 0 <= values[0] <= values[1] <= values[2], (name, values)
        if records is not None:
            largest = max(v for r in records if (v := getattr(r, name)) is not None)
            assert values[2] <= largest + 1e-12, (name, values)
    if row["ok"]:
        for q in (50, 90, 99):
            assert row[f"ttft_p{q}_s"] <= row[f"e2e_p{q}_s"] + 1e-12
    wait = row["retry_after_mean_s"]
    assert wait is None or (math.isfinite(wait) and wait >= 0), wait
    for klass_row in row.get("classes", {}).values():
        _check_row(klass_row)


def _strict_json(path: Path) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}: not strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@fuzz_settings(60)
@given(script=st.lists(answers(), min_size=1, max_size=8), chat=st.booleans())
def test_every_answer_is_counted_once_as_what_it_was(
    scripted: tuple[ScriptedServer, str], tmp_path: Path, script: list[Answer], chat: bool
) -> None:
    server, url = scripted
    server.script(dict(enumerate(script)))
    plan = [
        LoadRequest(rid=i, arrival=0.001 * i, prompt=f"Request {i}: go", prompt_len=4, max_tokens=8)
        for i in range(len(script))
    ]
    bounds = Bounds(request_timeout_s=30, drain_timeout_s=60)
    run = run_load(plan, Target(base=url, model="m", chat=chat), bounds)

    assert len(server.bodies) == len(script)  # each sent once, never retried
    records = []
    for out, answer in zip(run.outcomes, script, strict=True):
        note(f"{answer} -> {out}")
        status, tokens = answer.expected()
        assert out.status == status
        assert out.sent is not None
        record = to_record(out)
        records.append(record)
        if status == "ok":
            assert out.output_tokens == tokens
            assert record.ttft is not None
            assert record.e2e is not None
            assert 0 <= record.ttft <= record.e2e
        else:
            assert out.ended is not None
            assert out.ended >= out.sent
            assert record.e2e is None
        if status == "rejected":
            assert out.retry_after_s == answer.retry_after_s()
        if status == "error":
            assert out.error

    row = summarize_run(run)
    assert row["sent"] == len(script)
    assert row["ok"] == sum(a.expected()[0] == "ok" for a in script)
    assert row["rejected"] == sum(a.expected()[0] == "rejected" for a in script)
    assert row["output_tokens_total"] == sum(a.expected()[1] for a in script)
    _check_row(row, records)
    report = write_json(tmp_path / "row.json", row)
    assert _strict_json(report)["sent"] == len(script)


MAX_CONTEXT = 2048  # duetime load's default --max-context
#: Deadline budgets and prompt lengths, ordinary ones and ones at the edges of what can be
#: sent (deadline_ms > 0 and <= 1e9; prompt + output <= --max-context), some past them.
BUDGETS = st.floats(1e-3, 100)
EDGE_BUDGETS = st.one_of(BUDGETS, st.sampled_from([0.0, 1e-7, 4e-7, 6e-7, 1e-3, 1e6, 1e6 + 1]))
PROMPTS = st.integers(1, 40)
EDGE_PROMPTS = st.one_of(PROMPTS, st.just(MAX_CONTEXT - 1))
SENDABLE_TUFS = st.one_of(
    st.none(),
    st.builds(TimeUtility, ert=st.floats(0, 100), beta=st.floats(0.1, 10), alpha=st.floats(-10, 0)),
)


@st.composite
def load_cases(draw: Any) -> tuple[list[dict[str, Any]], dict[int, Answer], list[str]]:
    """(trace lines, the fake's answer per rid, extra options of `duetime load`)."""
    edges = draw(st.integers(0, 3)) == 0  # most cases are sent, some refused up front
    jobs = draw(
        trace_jobs(
            max_size=6,
            arrivals=st.floats(0, 0.03),
            budgets=EDGE_BUDGETS if edges else BUDGETS,
            priorities=st.integers(-1000, 1000),  # what duetime's server accepts
            klasses=st.text(min_size=1, max_size=12),
            prompt_lens=EDGE_PROMPTS if edges else PROMPTS,
            tufs=TUFS if edges else SENDABLE_TUFS,
        )
    )
    lines = []
    for job in jobs:
        line = job_to_dict(job)
        if job.request.priority == 0 and draw(st.booleans()):
            line["priority"] = 0  # given, though it is the default: it must win over --priority
        lines.append(line)
    answer_of = {job.request.rid: draw(answers()) for job in jobs}
    options: list[str] = []
    if draw(st.booleans()):
        options += ["--deadline", str(draw(st.sampled_from([0.5, 30.0])))]
    if draw(st.booleans()):
        options += ["--priority", str(draw(st.integers(-5, 5)))]
    options += draw(st.lists(st.sampled_from(["--chat", "--ignore-eos"]), unique=True))
    return lines, answer_of, options


def _option(options: list[str], name: str) -> str | None:
    return options[options.index(name) + 1] if name in options else None


def _refusal(line: dict[str, Any]) -> str | None:
    """The field `duetime load` must refuse this line for, or None if it can be sent."""
    if "deadline" in line:
        ms = round((line["deadline"] - line["arrival"]) * 1000.0, 3)  # as it is sent
        if not 0 < ms <= 1e9:
            return "deadline"
    if line["prompt_len"] + line["output_len"] > MAX_CONTEXT:
        return "prompt_len"
    tuf = line.get("tuf")
    if tuf is not None and not (
        round(tuf["ert"] * 1000.0, 3) <= 1e9 and 0 < tuf["beta"] <= 1e6 and tuf["alpha"] >= -1e6
    ):
        return "tuf"  # the limits of duetime's server, the only one that reads the field
    return None


def _expected_body(line: dict[str, Any], options: list[str]) -> dict[str, Any]:
    """The per-request fields the body must carry (None: must be absent)."""
    deadline_s = _option(options, "--deadline")
    budget = line["deadline"] - line["arrival"] if "deadline" in line else deadline_s
    priority = _option(options, "--priority")
    overrun = line.get("overrun")
    tuf = line.get("tuf")
    return {
        "max_tokens": line["output_len"],
        "deadline_ms": None if budget is None else round(float(budget) * 1000.0, 3),
        "priority": line["priority"] if "priority" in line else priority and int(priority),
        "klass": None if line.get("klass", "default") == "default" else line["klass"],
        "overrun": None if overrun is None else overrun.replace("-", "_"),
        "kv_eviction": line.get("kv_eviction"),
        "tuf": None
        if tuf is None
        else {"ert_ms": round(tuf["ert"] * 1000.0, 3), "beta": tuf["beta"], "alpha": tuf["alpha"]},
        "ignore_eos": True if "--ignore-eos" in options else None,
        "min_tokens": line["output_len"] if "--ignore-eos" in options else None,
    }


@fuzz_settings(40)
@given(case=load_cases())
def test_a_trace_is_sent_with_every_field_and_reported_in_strict_json(
    scripted: tuple[ScriptedServer, str],
    tmp_path: Path,
    case: tuple[list[dict[str, Any]], dict[int, Answer], list[str]],
) -> None:
    lines, answer_of, options = case
    server, url = scripted
    server.script(answer_of)
    trace, report = tmp_path / "t.jsonl", tmp_path / "load.json"
    report.unlink(missing_ok=True)
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    args = ["load", "--url", url, "--workload", str(trace), "--json", str(report), *options]
    res = runner.invoke(app, args)
    note(res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    refused = {i + 1: field for i, line in enumerate(lines) if (field := _refusal(line))}
    if refused:  # nothing is sent, nothing written, and the message says where
        assert res.exit_code == 2
        (message,) = [text for text in res.output.splitlines() if text.strip()]
        where = re.match(rf"error: {re.escape(str(trace))}:(\d+): field '(\w+)'", message)
        assert where, message
        assert refused.get(int(where.group(1))) == where.group(2) or (
            where.group(2) == "output_len" and refused.get(int(where.group(1))) == "prompt_len"
        ), message
        assert server.bodies == []
        assert not report.exists()
        return
    assert res.exit_code == 0, res.output

    assert server.refused == []  # duetime's own server takes every body duetime load sends
    bodies = {int(re.match(r"Request (\d+):", _prompt(b)).group(1)): b for b in server.bodies}  # type: ignore[union-attr]
    assert sorted(bodies) == sorted(answer_of)  # each request sent exactly once
    assert len(server.bodies) == len(lines)
    for line in lines:
        body = bodies[line["rid"]]
        for key, value in _expected_body(line, options).items():
            assert body.get(key) == value, (key, body, line)

    (row,) = _strict_json(report)["rows"]
    assert row["run"] == "trace"
    assert row["sent"] == len(lines)
    expected = [answer_of[line["rid"]].expected() for line in lines]
    assert row["ok"] == sum(status == "ok" for status, _ in expected)
    assert row["rejected"] == sum(status == "rejected" for status, _ in expected)
    assert row["errors"] == sum(status == "error" for status, _ in expected)
    assert row["output_tokens_total"] == sum(tokens for status, tokens in expected)
    _check_row(row)


def _prompt(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"] if "messages" in body else body["prompt"])


# --- what the properties above found, kept as plain regressions --------------------------------


@pytest.mark.parametrize(
    ("answer", "status", "tokens", "retry_after_s"),
    [
        # "choices" an object: a KeyError escaped the request's task, which stayed "unfinished"
        (Answer("odd_choices"), "error", 0, None),
        # usage.completion_tokens -1 or true was summed into output_tokens_total
        (Answer("stream", tokens=2, usage=-1), "ok", 2, None),
        (Answer("stream", tokens=2, usage=True), "ok", 2, None),
        # a redirect with a JSON body that is no error was counted "ok" with 0 tokens
        (Answer("status", tokens=2, status=307), "error", 0, None),
        # Retry-After -1, nan or inf was kept, and retry_after_mean_s went negative or NaN
        (Answer("status", status=429, retry_after="-1"), "rejected", 0, None),
        (Answer("status", status=429, retry_after="nan"), "rejected", 0, None),
        (Answer("status", status=429, retry_after="1.5"), "rejected", 0, 1.5),
    ],
)
def test_a_strange_answer_ends_as_what_it_was(
    scripted: tuple[ScriptedServer, str],
    answer: Answer,
    status: str,
    tokens: int,
    retry_after_s: float | None,
) -> None:
    server, url = scripted
    server.script({0: answer})
    plan = [LoadRequest(rid=0, arrival=0.0, prompt="Request 0: go", prompt_len=4, max_tokens=8)]
    (out,) = run_load(plan, Target(base=url, model="m"), Bounds(request_timeout_s=30)).outcomes
    assert (out.status, out.output_tokens, out.retry_after_s) == (status, tokens, retry_after_s)


def test_a_server_error_quoting_markup_is_printed_not_a_traceback(
    scripted: tuple[ScriptedServer, str], tmp_path: Path
) -> None:
    """'[/INST]' in an error body was read as a rich closing tag: a MarkupError traceback after
    the run, before the JSON was written."""
    server, url = scripted
    server.script({0: Answer("status", tokens=1, status=500)})
    trace, report = tmp_path / "t.jsonl", tmp_path / "load.json"
    trace.write_text('{"rid": 0, "arrival": 0, "prompt_len": 4, "output_len": 2}\n')
    res = runner.invoke(
        app, ["load", "--url", url, "--workload", str(trace), "--json", str(report)]
    )
    assert res.exit_code == 0, res.exception
    assert "[/INST]" in res.output
    assert _strict_json(report)["rows"][0]["errors"] == 1
