"""How `duetime load` builds and checks its workload and target, without a server:
class options, seeded synthetic and ShareGPT workloads, the per-request fields a trace
sends, trace lines that cannot be sent, the loopback check, and the command line's
refusals (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from duetime.server.load_target import TargetRefusedError, base_url, check_target, is_loopback
from duetime.server.load_workload import (
    LoadWorkload,
    parse_class_values,
    parse_deadlines,
    parse_mix,
)
from duetime.server.loadgen import Target, request_body
from tests.load_fake_server import invoke_load

# --- parsing ---------------------------------------------------------------------------------


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
    code, output = invoke_load("--url", "http://192.0.2.7:8000", "--workload", "synthetic")
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
    code, output = invoke_load("--workload", str(trace), "--model", "m")
    assert code == 2
    assert "bad.jsonl:2" in output
    assert "prompt_len" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("options", "named"),
    [(("--rate", "3"), "--rate"), (("--arrival", "gamma", "--cv", "2"), "--arrival, --cv"),
     (("--burst-size", "4"), "--burst-size")],
)  # fmt: skip
def test_an_option_that_draws_arrivals_is_refused_with_a_trace(
    tmp_path: Path, options: tuple[str, ...], named: str
) -> None:
    """A trace's arrival times are its own: --rate 3 was ignored in silence, and the JSON
    recorded the arrival, cv and burst size that played no part."""
    trace, j = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text('{"rid": 0, "arrival": 0.0, "prompt_len": 10, "output_len": 5}\n')
    code, output = invoke_load("--workload", str(trace), "--model", "m", *options,
                               "--json", str(j))  # fmt: skip
    assert code == 2, output
    assert f"{named}: a trace file brings its own requests and arrival times" in output
    assert not j.exists()


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


# --- found by tests/test_load_generator_properties.py ------------------------------------------


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
    # "--deadline for '*'" spoke of the catch-all class a plain number sets
    with pytest.raises(ValueError, match="--deadline must be a number of seconds > 0"):
        parse_deadlines(["1e-7"])
    with pytest.raises(ValueError, match="--deadline for class 'batch' must be a number"):
        parse_deadlines(["batch=-1"])
    with pytest.raises(ValueError, match="<= 1e\\+06"):
        parse_deadlines(["2e6"])


def test_a_workload_that_is_no_name_nor_file_is_named() -> None:
    """It said "nope: cannot read: No such file or directory", naming neither the option
    nor the workloads load takes."""
    with pytest.raises(ValueError, match="unknown workload 'nope': load takes sharegpt, synth"):
        LoadWorkload(workload="nope").build(1.0)
    with pytest.raises(ValueError, match=r"--workload x/t\.jsonl: the trace file does not exist"):
        LoadWorkload(workload="x/t.jsonl").build(1.0)


def test_a_duration_of_nothing_is_refused() -> None:
    from tests.factories import cli_refused

    cli_refused(
        "load", "--url", "http://127.0.0.1:9", "--duration", "0", names="--duration must be > 0 s"
    )
