"""Properties of JSONL trace files, drawn by hypothesis.

Two families, each over inputs a person could really produce:

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

The load generator's properties are in tests/test_load_generator_properties.py.
``DUETIME_FUZZ_EXAMPLES=N`` deepens the search (see tests/trace_strategies.py): each
test here runs N/25 times its own default number of examples (``=500``: twenty times).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from typer.testing import CliRunner

from duetime.cli import app
from duetime.core.request import Job
from duetime.workloads.trace import (
    TraceError,
    job_to_dict,
    read_trace,
    write_trace,
)
from tests.trace_strategies import fuzz_settings, trace_jobs

runner = CliRunner()


def _by_arrival(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=lambda job: job.request.arrival)


# --- 1. round trip -----------------------------------------------------------------------------


@fuzz_settings(60)
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


@fuzz_settings(150)
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


@fuzz_settings(25)
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
