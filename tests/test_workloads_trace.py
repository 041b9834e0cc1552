"""JSONL traces: exact error locations, round trip, atomic writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from duetime.core.request import Job, Request, TimeUtility
from duetime.workloads.trace import TraceError, read_trace, write_trace

GOOD = {"rid": 0, "arrival": 0.5, "prompt_len": 10, "output_len": 4}


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _line(**fields: object) -> str:
    return json.dumps({**GOOD, **fields})


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    jobs = [
        Job(Request(rid=0, arrival=0.0, prompt_len=7), output_len=3),
        Job(
            Request(
                rid=1,
                arrival=0.1 + 0.2,  # not exactly representable: must survive unchanged
                prompt_len=100,
                max_tokens=64,
                deadline=2.75,
                priority=-3,
                klass="robot",
                tuf=TimeUtility(ert=1.5, beta=2.0, alpha=-0.5),
                overrun="skip-next",
                kv_eviction=0.25,
            ),
            output_len=60,
            segments=(20, 30, 10),
            segment_gaps=(0.25, 1.0),
            segment_gap_estimates=(0.25, 0.5),
        ),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, jobs) == 2
    back = read_trace(path)
    assert back == jobs


def test_a_trace_carries_each_requests_overrun_and_eviction(tmp_path: Path) -> None:
    """A client can set both per request (the server takes them); a trace dropped them."""
    jobs = [
        Job(Request(rid=i, arrival=0.0, prompt_len=5, overrun=o, kv_eviction=e), 2)
        for i, (o, e) in enumerate([("kill", "auto"), (None, "off"), ("skip-next", 0.0)])
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, jobs)
    assert [(j.request.overrun, j.request.kv_eviction) for j in read_trace(path)] == [
        ("kill", "auto"),
        (None, "off"),
        ("skip-next", 0.0),
    ]


def test_lines_are_sorted_by_arrival_and_rids_kept(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "t.jsonl",
        [_line(rid=7, arrival=3.0), _line(rid=2, arrival=1.0), _line(rid=5, arrival=3.0)],
    )
    jobs = read_trace(path)
    assert [j.request.rid for j in jobs] == [2, 7, 5]  # ties keep file order


BAD_LINES = [
    (_line(prompt_len=0), "field 'prompt_len': must be >= 1, got 0"),
    (_line(output_len=-2), "field 'output_len': must be >= 1, got -2"),
    (_line(prompt_len=3.0), "field 'prompt_len': must be an integer, got 3.0"),
    (_line(prompt_len="3"), "field 'prompt_len': must be an integer, got \"3\""),
    (_line(arrival=-1), "field 'arrival': must be >= 0"),
    (_line(arrival="soon"), "field 'arrival': must be a number"),
    # past ~1e17 s a step no longer moves a double clock: latencies 0, runs that never end
    (_line(arrival=1e50), "field 'arrival': must be <= 1000000000.0"),
    (_line(arrival=1.0, deadline=1e300), "field 'deadline': must be <= 1000000000.0"),
    (_line(tuf={"ert": 1e20}), "field 'tuf.ert': must be <= 1000000000.0"),
    (
        _line(output_len=5, segments=[2, 3], segment_gaps=[1e18]),
        "field 'segment_gaps[0]': must be <= 1000000000.0",
    ),
    (
        '{"rid": 0, "arrival": NaN, "prompt_len": 1, "output_len": 1}',
        "field 'arrival': must be a finite",
    ),
    (json.dumps({"rid": 0, "arrival": 0, "output_len": 1}), "field 'prompt_len': required field"),
    (_line(promt_len=5), "field 'promt_len': unknown field"),
    (_line(rid=-1), "field 'rid': must be >= 0"),
    (_line(tuf={"beta": 1.0}), "field 'tuf.ert': required field"),
    (_line(tuf={"ert": 1.0, "alpha": 0.5}), "field 'tuf.alpha': must be <= 0"),
    (_line(output_len=5, segments=[2, 0, 3]), "field 'segments[1]': must be >= 1"),
    (_line(output_len=5, segments=[2, 2]), "field 'segments': must sum to output_len (5)"),
    (_line(output_len=5, segments=[2, 3], segment_gaps=[1, 2]), "field 'segment_gaps': needs"),
    (_line(segment_gaps=[1.0]), "field 'segment_gaps': given without segments"),
    (
        _line(output_len=5, segments=[2, 3], segment_gaps=[1.0], segment_gap_estimates=[1, 2]),
        "field 'segment_gap_estimates': needs one entry per segment gap (1), got 2",
    ),
    (
        _line(output_len=5, segments=[2, 3], segment_gaps=[1.0], segment_gap_estimates=[-1]),
        "field 'segment_gap_estimates[0]': must be >= 0",
    ),
    (_line(arrival=5.0, deadline=4.0), "field 'deadline': must be >= arrival (5.0)"),
    (_line(output_len=9, max_tokens=8), "field 'output_len': 9 exceeds max_tokens 8"),
    (_line(output_len=5000), "exceeds max_tokens 4096 (the default; give max_tokens)"),
    (_line(klass=""), "field 'klass': must not be empty"),
    (_line(overrun="skip_next"), "field 'overrun': Input should be 'kill' or 'skip-next'"),
    (_line(kv_eviction=1.5), "field 'kv_eviction': must be 'off', 'auto' or a ratio in [0, 1)"),
    (_line(kv_eviction=True), "field 'kv_eviction': must be 'off', 'auto' or a ratio"),
    (_line(kv_eviction="always"), "field 'kv_eviction': must be 'off', 'auto' or a ratio"),
    ('{"rid": 0, "arrival": 0,', "invalid JSON: "),
    ("[1, 2]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_bad_line_names_file_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    # line 3 is bad; the blank line 2 still counts in the numbering
    path = _write_lines(tmp_path / "trace.jsonl", [_line(rid=10), "", bad, _line(rid=11)])
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    text = str(caught.value)
    assert text.startswith(f"{path}:3: ")
    assert message in text


def test_duplicate_rid_names_both_lines(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "t.jsonl", [_line(rid=4), _line(rid=5), _line(rid=4)])
    with pytest.raises(
        TraceError, match=r"t\.jsonl:3: field 'rid': duplicate rid 4 \(first on line 1\)"
    ):
        read_trace(path)


def test_missing_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot read: No such file"):
        read_trace(tmp_path / "nope.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(_line().encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r"bin\.jsonl:2: not UTF-8 text \(byte 0xff at column 1\)"):
        read_trace(binary)


def test_empty_trace_reads_as_no_jobs(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    write_trace(path, [])
    assert path.read_text() == ""
    assert read_trace(path) == []


def _jobs_then_crash(n: int):
    for rid in range(n):
        yield Job(Request(rid=rid, arrival=float(rid), prompt_len=5), output_len=2)
    raise RuntimeError("disk on fire")


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [Job(Request(rid=99, arrival=0.0, prompt_len=1), output_len=1)])
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_trace(path, _jobs_then_crash(3))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_failed_write_to_new_path_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        write_trace(tmp_path / "new.jsonl", _jobs_then_crash(2))
    assert list(tmp_path.iterdir()) == []


# --- found by tests/test_trace_file_properties.py ------------------------------------------------


def test_a_trace_read_and_written_again_is_the_same_file(tmp_path: Path) -> None:
    """An int arrival (or ratio, gap, ERT) was written "5", read back as 5.0, rewritten "5.0"."""
    job = Job(
        Request(rid=0, arrival=5, prompt_len=3, deadline=7, kv_eviction=0, tuf=TimeUtility(ert=1)),
        output_len=2,
        segments=(1, 1),
        segment_gaps=(0,),
    )
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(first, [job])
    write_trace(second, read_trace(first))
    assert second.read_bytes() == first.read_bytes()
    assert '"arrival":5.0,' in first.read_text()


def test_a_key_given_twice_in_a_line_is_refused(tmp_path: Path) -> None:
    """JSON keeps the last of two "rid"s: the trace silently meant another request."""
    path = _write_lines(tmp_path / "t.jsonl", [_line(), _line(rid=1)[:-1] + ', "rid": 2}'])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'rid': given more than once$"):
        read_trace(path)


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    """Windows editors start a UTF-8 file with one; it was 'invalid JSON: Unexpected UTF-8 BOM'."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (_line() + "\r\n").encode())
    assert [job.request.rid for job in read_trace(path)] == [0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (  # json raised a plain ValueError: the CLI printed it without the file or line
            '{"rid": ' + "1" * 5000 + "}",
            "invalid JSON: Exceeds the limit (4300 digits)",
        ),
        ("[" * 100_000, "invalid JSON: nested too deeply"),  # a RecursionError traceback
        (_line(klass=["x" * 10_000]), 'must be a string, got ["xxxxxxxx'),  # 10 kB message
        (_line(**{"a\x1b[2Jb": 1}), "field 'a\\x1b[2Jb': unknown field"),  # a terminal escape
    ],
)
def test_a_huge_deep_or_odd_line_is_one_short_line(tmp_path: Path, text: str, message: str) -> None:
    path = _write_lines(tmp_path / "t.jsonl", [_line(rid=5), text])
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:2: ")
    assert message in str(caught.value)
    assert len(str(caught.value)) < len(str(path)) + 200


@pytest.mark.parametrize(
    ("jobs", "message"),
    [
        ([Job(Request(rid=0, arrival=2.0, prompt_len=1, deadline=1.0), 1)], "field 'deadline'"),
        ([Job(Request(rid=0, arrival=0.0, prompt_len=1, deadline=math.nan), 1)], "finite"),
        ([Job(Request(rid=0, arrival=0.0, prompt_len=1, max_tokens=2), 3)], "exceeds max_tokens"),
        ([Job(Request(rid=0, arrival=0.0, prompt_len=1, klass=""), 1)], "field 'klass'"),
        (
            [Job(Request(rid=4, arrival=0.0, prompt_len=1), 1)] * 2,
            r"job 2 \(rid 4\): field 'rid': also the rid of job 1",
        ),
    ],
)
def test_write_refuses_a_job_the_reader_would_refuse(
    tmp_path: Path, jobs: list[Job], message: str
) -> None:
    """write_trace wrote these, and every command then refused the file it had made."""
    path = tmp_path / "t.jsonl"
    with pytest.raises(TraceError, match=message) as caught:
        write_trace(path, jobs)
    assert str(caught.value).startswith(f"cannot write {path}: job ")
    assert list(tmp_path.iterdir()) == []
