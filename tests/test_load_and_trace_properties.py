"""Properties of JSONL traces and of `duetime load`, drawn by hypothesis.

Three families, each over inputs a person or a server could really produce:

1. **Round trip.** Any list of jobs the trace format can hold (every field:
   arrival, lengths, max_tokens, deadline, priority, class, TUF, segments and
   gaps, overrun, kv_eviction) is read back equal, and writing what was read
   gives the same bytes.
2. **Damaged traces.** One line of a valid trace is broken (a wrong type, a
   missing or unknown field, a negative, NaN or infinite number, a repeated
   key, bad JSON, a cut-off last line), and harmless variations are mixed in
   (blank lines, a BOM, CRLF endings, no final newline). The file either loads
   as intended or raises one :class:`TraceError` line naming the file, the
   line and the field; the CLI exits 2 with that line and writes no output file.
3. **The load generator** against a fake OpenAI-compatible server whose answer
   to each request is drawn: streamed or whole, slow or fast, HTTP errors,
   429s, redirects, error events, malformed or cut-off streams, empty answers,
   odd ``usage``. Every request is counted once, in the state its answer
   calls for, with the tokens the fake sent; percentiles are ordered and
   TTFT <= e2e; the JSON report is strict JSON with unit-named keys; and every
   body the fake receives carries the trace's per-request fields and is one
   duetime's own server accepts.

``DUETIME_FUZZ_EXAMPLES=N`` deepens the search as it does for
tests/test_sim_invariants_all_policies.py, whose default is 25: each test here
runs N/25 times its own default number of examples (``=500``: twenty times).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from duetime.cli import app
from duetime.core.request import MAX_TIME_S, Job, TimeUtility
from duetime.core.request import Request as CoreRequest
from duetime.metrics import write_json
from duetime.server.load_report import summarize_run, to_record
from duetime.server.load_workload import LoadRequest
from duetime.server.loadgen import Bounds, Target, run_load
from duetime.server.schemas import ChatCompletionRequest, CompletionRequest
from duetime.server.threaded import serve_in_thread
from duetime.workloads.trace import (
    TraceError,
    job_to_dict,
    read_trace,
    write_trace,
)

SCALE = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "25")) / 25
runner = CliRunner()


def _settings(examples: int) -> Any:
    return settings(
        max_examples=max(1, round(examples * SCALE)),
        deadline=None,
        derandomize=True,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --- strategies: jobs a trace can hold ---------------------------------------------------------

SECONDS = st.floats(0, MAX_TIME_S, allow_nan=False, allow_infinity=False)
#: Numbers a caller may hand Request: ints too (``arrival=5``), which JSON spells without ".0".
REALS = st.one_of(SECONDS, st.integers(0, 10**6))
ANY_INT = st.integers()
NAMES = st.text(min_size=1, max_size=12)
PROMPT_LENS = st.integers(1, 10**6)
TUFS = st.one_of(
    st.none(),
    st.builds(TimeUtility, ert=REALS, beta=st.floats(-1e6, 1e6), alpha=st.floats(-1e6, 0)),
)


@st.composite
def _segments(draw: Any, output_len: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if output_len < 2 or not draw(st.booleans()):
        return (), ()
    cuts = draw(st.lists(st.integers(1, output_len - 1), max_size=4, unique=True))
    bounds = [0, *sorted(cuts), output_len]
    segments = tuple(b - a for a, b in itertools.pairwise(bounds))
    if draw(st.booleans()):
        return segments, ()
    gaps = draw(st.lists(REALS, min_size=len(segments) - 1, max_size=len(segments) - 1))
    return segments, tuple(gaps)


@st.composite
def trace_jobs(
    draw: Any,
    *,
    max_size: int = 6,
    arrivals: st.SearchStrategy[Any] = REALS,
    budgets: st.SearchStrategy[Any] = REALS,
    priorities: st.SearchStrategy[int] = ANY_INT,
    klasses: st.SearchStrategy[str] = NAMES,
    prompt_lens: st.SearchStrategy[int] = PROMPT_LENS,
    tufs: st.SearchStrategy[TimeUtility | None] = TUFS,
) -> list[Job]:
    """Jobs with distinct rids and any mix of optional fields (all within the format's rules)."""
    rids = draw(st.lists(st.integers(0, 2**70), max_size=max_size, unique=True))
    jobs = []
    for rid in rids:
        arrival = draw(arrivals)
        output_len = draw(st.integers(1, 300))
        segments, gaps = draw(_segments(output_len))
        tuf = draw(tufs)
        kv_eviction = draw(
            st.one_of(
                st.none(),
                st.sampled_from(["off", "auto"]),
                st.floats(0, 1, exclude_max=True),
            )
        )
        request = CoreRequest(
            rid=rid,
            arrival=arrival,
            prompt_len=draw(prompt_lens),
            max_tokens=draw(st.one_of(st.just(4096), st.integers(output_len, 10**6))),
            deadline=draw(
                st.one_of(st.none(), budgets.map(lambda b, a=arrival: min(a + b, MAX_TIME_S)))
            ),
            priority=draw(priorities),
            tuf=tuf,
            klass=draw(st.one_of(st.just("default"), klasses)),
            overrun=draw(st.sampled_from([None, "kill", "skip-next"])),
            kv_eviction=kv_eviction,
        )
        jobs.append(Job(request, output_len, segments, gaps))
    return jobs


def _by_arrival(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=lambda job: job.request.arrival)


# --- 1. round trip -----------------------------------------------------------------------------


@_settings(60)
@given(jobs=trace_jobs())
def test_any_trace_round_trips_and_rewrites_to_the_same_bytes(
    tmp_path: Path, jobs: list[Job]
) -> None:
    path = tmp_path / "t.jsonl"
    assert write_trace(path, jobs) == len(jobs)
    back = read_trace(path)
    assert back == _by_arrival(jobs)

    write_trace(path, _by_arrival(jobs))
    first = path.read_bytes()
    write_trace(path, back)
    assert path.read_bytes() == first


# --- 2. damaged traces -------------------------------------------------------------------------

INT_FIELDS = ("rid", "prompt_len", "output_len", "max_tokens")
#: For each field, values of the wrong type (never a valid spelling of any value).
WRONG_TYPE: dict[str, list[Any]] = {
    **{f: ["5", 5.5, 5.0, True, [], {}] for f in INT_FIELDS},
    "priority": ["1", 1.0, False, None, [1]],
    "arrival": ["1", True, [], {}, None],
    "deadline": ["1", True, [], {}],
    "klass": [5, True, [], {}, None, ""],
    "tuf": [5, "x", [], {"ert": -1}, {"ert": 1, "alpha": 1}, {"ert": 1, "gamma": 1}, {}],
    "segments": [5, "x", {}, None, [True], ["1"]],
    "segment_gaps": [5, "x", None, [True], ["0.5"]],
    "overrun": [5, "kil", "skip_next", True, []],
    "kv_eviction": [True, "x", 1, 1.0, -0.1, [], {}],
}
REQUIRED = ("rid", "arrival", "prompt_len", "output_len")
#: Numbers that are no valid value of these fields, spelled as raw JSON text.
BAD_NUMBERS: dict[str, list[str]] = {
    **{f: ["-1", "0", "NaN", "Infinity", "1e3", "-0.0"] for f in INT_FIELDS if f != "rid"},
    "rid": ["-1", "NaN", "Infinity", "1e3", "0.0", "1" * 5000],
    "arrival": ["-1", "-1e-300", "NaN", "Infinity", "-Infinity", "1" + "0" * 400, "1e999"],
    "deadline": ["-1", "NaN", "Infinity", "1e999"],
    "priority": ["NaN", "Infinity", "1.5"],
}
MUTATIONS = (
    "wrong_type",
    "missing",
    "bad_number",
    "unknown",
    "repeated_key",
    "duplicate_rid",
    "bad_json",
    "not_object",
    "cut_last_line",
)


@dataclass
class Damage:
    """One broken line: its index among the trace's lines, its text, the field it names."""

    index: int
    text: str
    field: str | None  # None: the error is about the line, not a field (bad JSON)


def _raw(fields: dict[str, Any], override: dict[str, str] | None = None) -> str:
    """One JSON line; ``override`` puts raw text (NaN, 1e999) where json.dumps cannot."""
    parts = [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in fields.items()]
    parts += [f"{json.dumps(k)}:{v}" for k, v in (override or {}).items()]
    return "{" + ",".join(parts) + "}"


@st.composite
def damaged(draw: Any, lines: list[dict[str, Any]]) -> Damage | None:
    """Break one of ``lines`` (dicts of a valid trace, in file order), or none (None)."""
    if not lines or not draw(st.booleans()):
        return None
    index = draw(st.integers(0, len(lines) - 1))
    line = dict(lines[index])
    kind = draw(st.sampled_from(MUTATIONS))
    if kind == "wrong_type":
        field = draw(st.sampled_from(sorted(WRONG_TYPE)))
        line[field] = draw(st.sampled_from(WRONG_TYPE[field]))
        return Damage(index, _raw(line), field)
    if kind == "missing":
        field = draw(st.sampled_from(REQUIRED))
        del line[field]
        return Damage(index, _raw(line), field)
    if kind == "bad_number":
        field = draw(st.sampled_from(sorted(BAD_NUMBERS)))
        value = draw(st.sampled_from(BAD_NUMBERS[field]))
        line.pop(field, None)
        if field == "deadline" and value == "-1":
            line["arrival"] = 0.0
        too_long = len(value) > 4300  # Python refuses to read such an int at all: bad JSON
        return Damage(index, _raw(line, {field: value}), None if too_long else field)
    if kind == "unknown":
        field = draw(
            st.one_of(
                st.sampled_from(["promt_len", "deadline_ms", "Priority", "predicted"]),
                st.text(min_size=1, max_size=8),
            ).filter(lambda name: name not in line and name not in WRONG_TYPE)
        )
        line[field] = draw(st.sampled_from([1, "x", None]))
        return Damage(index, _raw(line), field)
    if kind == "repeated_key":  # JSON keeps the last; a trace must not guess which was meant
        field = draw(st.sampled_from(sorted(line)))
        return Damage(index, _raw(line, {field: json.dumps(line[field])}), field)
    if kind == "duplicate_rid":
        if len(lines) < 2:
            return None
        other = draw(st.integers(0, len(lines) - 1).filter(lambda i: i != index))
        line["rid"] = lines[other]["rid"]
        return Damage(max(index, other), _raw(line), "rid") if index > other else None
    text = _raw(line)
    if kind == "bad_json":
        cut = draw(st.integers(1, len(text) - 1))
        return Damage(index, text[:cut], None)
    if kind == "not_object":
        return Damage(index, json.dumps(draw(st.sampled_from([[line], 5, "x", None]))), None)
    # cut_last_line: the file ends in the middle of its last line (a copy that stopped)
    cut = draw(st.integers(1, len(text) - 1))
    return Damage(len(lines) - 1, _raw(lines[-1])[:cut], None) if index == len(lines) - 1 else None


@st.composite
def trace_files(draw: Any) -> tuple[bytes, list[Job], Damage | None, int]:
    """(file bytes, the jobs it means, the damage or None, the damaged line's 1-based number)."""
    jobs = draw(trace_jobs(max_size=5))
    lines = [job_to_dict(job) for job in jobs]
    if draw(st.booleans()):  # key order is free, and a line may give max_tokens or not
        lines = [dict(reversed(line.items())) for line in lines]
    damage = draw(damaged(lines))
    texts = [_raw(line) for line in lines]
    if damage is not None:
        texts[damage.index] = damage.text
    physical: list[str] = []
    number = 0
    for i, text in enumerate(texts):
        physical += draw(st.lists(st.sampled_from(["", " ", "\t", "  \t "]), max_size=2))
        physical.append(draw(st.sampled_from(["", " ", "\t"])) + text)
        if damage is not None and i == damage.index:
            number = len(physical)
    cut_last = damage is not None and damage.index == len(lines) - 1 and damage.field is None
    final_newline = not cut_last and draw(st.booleans())
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    body = eol.join(physical) + (eol if final_newline and physical else "")
    bom = "\ufeff" if draw(st.booleans()) else ""
    return (bom + body).encode("utf-8"), jobs, damage, number


def _check_error(message: str, path: Path, damage: Damage, number: int) -> None:
    """One line, starting with ``path:line:``, naming the field, and of readable length."""
    assert "\n" not in message, message
    assert message.startswith(f"{path}:{number}: "), message
    if damage.field is not None:
        name = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in damage.field)
        assert f"field '{name[:30]}" in message, message
    assert len(message) < len(str(path)) + 300, message


@_settings(150)
@given(case=trace_files())
def test_a_damaged_trace_loads_as_meant_or_names_file_line_and_field(
    tmp_path: Path, case: tuple[bytes, list[Job], Damage | None, int]
) -> None:
    data, jobs, damage, number = case
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    note(data.decode("utf-8", "replace"))
    if damage is None:
        assert read_trace(path) == _by_arrival(jobs)
        return
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    _check_error(str(caught.value), path, damage, number)


@_settings(25)
@given(
    case=trace_files().filter(lambda case: case[2] is not None),
    command=st.sampled_from(["load", "sim"]),
)
def test_the_cli_refuses_a_damaged_trace_with_one_line_and_writes_nothing(
    tmp_path: Path, case: tuple[bytes, list[Job], Damage | None, int], command: str
) -> None:
    data, _, damage, number = case
    assert damage is not None
    path, report = tmp_path / "t.jsonl", tmp_path / "out" / "report.json"
    path.write_bytes(data)
    args = ["--workload", str(path), "--json", str(report)]
    if command == "load":
        args += ["--model", "m"]  # no server is asked: the trace is read first
    res = runner.invoke(app, [command, *args])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output
    (line,) = [text for text in res.output.splitlines() if text.strip()]
    _check_error(line.removeprefix("error: "), path, damage, number)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [path]  # no report, no temporary


# --- 3. the load generator against a fake server -----------------------------------------------

KINDS = ("stream", "whole", "status", "error_event", "bad_chunk", "cut", "odd_choices")
RETRY_AFTER = [None, "2", "0", "0.5", "-1", "nan", "inf", "Wed, 21 Oct 2015 07:28:00 GMT"]


@dataclass(frozen=True)
class Answer:
    """What the fake server does with one request, and what the client must make of it."""

    kind: str
    tokens: int = 0  # text chunks streamed (whole: text or none)
    usage: Any = None  # usage.completion_tokens sent (None: no usage); may be nonsense
    done: bool = True  # the stream ends with "data: [DONE]" (else the body just ends)
    status: int = 200
    retry_after: str | None = None
    delay_s: float = 0.0  # before the answer starts
    gap_s: float = 0.0  # between chunks

    @property
    def usage_ok(self) -> bool:
        return isinstance(self.usage, int) and not isinstance(self.usage, bool) and self.usage >= 0

    def expected(self) -> tuple[str, int]:
        """(the outcome's status, its output tokens if ok)."""
        if self.kind == "status":
            return ("rejected" if self.status == 429 else "error"), 0
        if self.kind not in ("stream", "whole"):
            return "error", 0
        text_chunks = self.tokens if self.kind == "stream" else min(self.tokens, 1)
        return "ok", self.usage if self.usage_ok else text_chunks

    def retry_after_s(self) -> float | None:
        try:
            value = float(self.retry_after) if self.retry_after is not None else None
        except ValueError:
            return None
        return value if value is not None and math.isfinite(value) and value >= 0 else None


@st.composite
def answers(draw: Any) -> Answer:
    kind = draw(st.sampled_from(KINDS))
    status = 200
    if kind == "status":
        status = draw(st.sampled_from([204, 301, 302, 307, 400, 404, 413, 422, 429, 500, 503]))
    return Answer(
        kind=kind,
        tokens=draw(st.integers(0, 6)),
        usage=draw(st.one_of(st.none(), st.integers(0, 9), st.sampled_from([-1, True, 2.5, "3"]))),
        done=draw(st.booleans()),
        status=status,
        retry_after=draw(st.sampled_from(RETRY_AFTER)),
        delay_s=draw(st.sampled_from([0.0, 0.0, 0.002, 0.01])),
        gap_s=draw(st.sampled_from([0.0, 0.001, 0.004])),
    )


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ScriptedServer:
    """Answers request ``Request <rid>: ...`` as ``answers[rid]`` says; keeps every body and
    whether duetime's own server would have accepted it."""

    def __init__(self) -> None:
        self.answers: dict[int, Answer] = {}
        self.bodies: list[dict[str, Any]] = []
        self.refused: list[str] = []  # what duetime's schema says about bodies it would refuse
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.complete)
        self.app.post("/v1/chat/completions")(self.complete)

    def script(self, answers: dict[int, Answer]) -> None:
        with self.lock:
            self.answers = dict(answers)
            self.bodies.clear()
            self.refused.clear()

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def complete(self, request: Request) -> Any:
        body = await request.json()
        chat = "messages" in body
        schema = ChatCompletionRequest if chat else CompletionRequest
        try:
            schema.model_validate(body)
        except ValidationError as e:
            self.refused.append(str(e))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        match = re.match(r"Request (\d+):", prompt)
        assert match, prompt
        with self.lock:
            self.bodies.append(body)
            answer = self.answers[int(match.group(1))]
        await asyncio.sleep(answer.delay_s)
        if answer.kind == "status":
            headers = {} if answer.retry_after is None else {"Retry-After": answer.retry_after}
            if answer.status == 204 or answer.tokens == 0:  # no body at all
                return Response(status_code=answer.status, headers=headers)
            # "[/INST]" (Llama 2's prompt format) in an error message is rich markup
            detail = {"error": "no [/INST]"} if answer.tokens % 2 else {"detail": "[/INST]"}
            return JSONResponse(detail, status_code=answer.status, headers=headers)
        usage = None if answer.usage is None else {"completion_tokens": answer.usage}
        if answer.kind == "whole":
            text = "w" * answer.tokens
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            whole: dict[str, Any] = {"choices": [{"index": 0, **choice}]}
            if usage is not None:
                whole["usage"] = usage
            return JSONResponse(whole)
        return StreamingResponse(self._stream(answer, chat, usage), media_type="text/event-stream")

    async def _stream(
        self, answer: Answer, chat: bool, usage: dict[str, Any] | None
    ) -> AsyncIterator[str]:
        if chat:  # a role-only first chunk, as vLLM sends: not a token
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        yield ": keep-alive\n\n"
        for i in range(answer.tokens):
            await asyncio.sleep(answer.gap_s)
            part = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield _sse({"choices": [{"index": 0, **part}]})
            yield _sse({"choices": [{"index": 0, "text": "", "delta": {}}]})  # no text: no token
            if answer.kind == "cut":
                raise RuntimeError("the fake server drops the connection")
        if answer.kind == "cut":
            raise RuntimeError("the fake server drops the connection")
        if answer.kind == "error_event":
            yield _sse({"error": {"message": "engine fell over", "code": 500}})
        elif answer.kind == "bad_chunk":
            yield "data: {not json\n\n"
        elif answer.kind == "odd_choices":
            yield _sse({"choices": {"0": {"text": "x"}}})
        yield _sse({"choices": [], **({} if usage is None else {"usage": usage})})
        if answer.done:
            yield "data: [DONE]\n\n"


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


@_settings(60)
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


@_settings(40)
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
