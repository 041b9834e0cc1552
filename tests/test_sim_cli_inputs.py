"""`duetime sim` / `sweep` / `demo`: what they write, and inputs they once mishandled.

Each case failed on the code before it: a saved trace without the run's
deadlines, or saved for a run that then failed; `sweep --arrival gamma`
silently Poisson; a sweep plot of a mistyped metric; a trace "swept" over
rates, or given options that draw a workload and ignoring them; a rate so low
the run hung; profiles and TUFs that read as something else; a `demo --out`
that failed after the work.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from tests.factories import cli_refused

runner = CliRunner()
SIM = ("sim", "--workload", "synthetic", "--requests", "40", "--rate", "12")


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, " ".join(res.output.replace("│", " ").split())


def _profile(tmp_path: Path, **changes: object) -> str:
    from duetime.sim.profiles import profile_path

    raw = json.loads(profile_path("a100-llama2-7b").read_text())
    coefficients = changes.pop("coefficients", {})
    raw["coefficients"].update(coefficients)
    raw.update(changes)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_saved_trace_carries_the_deadlines_the_run_used(tmp_path: Path) -> None:
    trace, first, again = tmp_path / "t.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    args = (*SIM, "--policy", "edf", "--deadline-scale", "2")
    code, out = _invoke(*args, "--save-trace", str(trace), "--json", str(first))
    assert code == 0, out
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 40
    assert all("deadline" in line for line in lines)
    code, out = _invoke("sim", "--workload", str(trace), "--policy", "edf", "--json", str(again))
    assert code == 0, out
    ran, replayed = (json.loads(p.read_text())["summary"] for p in (first, again))
    assert replayed["deadline_requests"] == ran["deadline_requests"] == 40
    assert replayed["deadline_hit_rate"] == ran["deadline_hit_rate"]
    assert replayed["rate_req_s"] is None  # a trace's arrivals are its own, not --rate's
    assert ran["rate_req_s"] == 12.0


@pytest.mark.parametrize(("option", "value"), [("--policy", "bogus"), ("--profile", "bogus")])
def test_no_trace_is_saved_for_a_run_that_cannot_start(
    tmp_path: Path, option: str, value: str
) -> None:
    trace = tmp_path / "t.jsonl"
    cli_refused(*SIM, option, value, "--save-trace", str(trace), names="bogus")
    assert not trace.exists()


def test_sweep_hands_cv_to_its_runs(tmp_path: Path) -> None:
    spans = {}
    for cv in ("1", "3"):
        j = tmp_path / f"cv{cv}.json"
        code, out = _invoke(
            "sweep", "--policies", "fcfs", "--rates", "8", "--workload", "synthetic",
            "--requests", "200", "--arrival", "gamma", "--cv", cv, "--workers", "1",
            "--json", str(j),
        )  # fmt: skip
        assert code == 0, out
        payload = json.loads(j.read_text())
        assert payload["specs"][0]["cv"] == float(cv)  # the settings of every row are kept
        spans[cv] = payload["rows"][0]["span_s"]
    assert spans["1"] != spans["3"]


def test_sweep_refuses_an_unknown_metric_before_running(tmp_path: Path) -> None:
    png = tmp_path / "s.png"
    out = cli_refused("sweep", "--metrics", "e2e_p90_s,bogus", "--plot", str(png), names="'bogus'")
    assert "ttft_p90_s" in out  # it says what a row has
    assert not png.exists()


def test_a_sweep_runs_a_repeated_name_or_number_once(tmp_path: Path) -> None:
    """`--rates 2,2 --seeds 0,0 --policies fcfs,fcfs` ran every run twice, under one label."""
    j = tmp_path / "s.json"
    code, out = _invoke(
        "sweep", "--requests", "50", "--policies", "fcfs,fcfs,edf", "--rates", "2,2",
        "--seeds", "0,0", "--replicas", "2,2", "--workers", "1", "--json", str(j),
    )  # fmt: skip
    assert code == 0, out
    assert sorted(r["policy"] for r in json.loads(j.read_text())["rows"]) == ["edf", "fcfs"]
    cli_refused("sweep", "--policies", "", names="--policies names no policy")


def test_an_infinite_rate_is_recorded_as_the_option_takes_it(tmp_path: Path) -> None:
    """JSON has no number for inf: it was written null, a trace's mark for "no rate"."""
    j = tmp_path / "s.json"
    code, out = _invoke("sim", "--requests", "20", "--rate", "inf", "--json", str(j))
    assert code == 0, out
    assert json.loads(j.read_text())["spec"]["rate"] == "inf"


def test_a_trace_sweeps_once_per_policy_and_seed_not_per_rate(tmp_path: Path) -> None:
    trace, j, png = tmp_path / "t.jsonl", tmp_path / "s.json", tmp_path / "s.png"
    assert _invoke(*SIM, "--save-trace", str(trace))[0] == 0
    code, out = _invoke(
        "sweep", "--workload", str(trace), "--policies", "fcfs,edf",
        "--seeds", "0,1", "--workers", "1", "--json", str(j), "--plot", str(png),
    )  # fmt: skip
    assert code == 0, out
    payload = json.loads(j.read_text())
    rows = payload["rows"]
    assert sorted((r["policy"], r["seed"]) for r in rows) == [
        ("edf", 0), ("edf", 1), ("fcfs", 0), ("fcfs", 1)
    ]  # fmt: skip
    assert {r["rate_req_s"] for r in rows} == {None}
    assert {s["rate"] for s in payload["specs"]} == {None}  # no default recorded as chosen
    assert png.stat().st_size > 0


@pytest.mark.parametrize(
    ("command", "options", "named"),
    [
        ("sim", ("--rate", "100"), "--rate"),
        ("sim", ("--requests", "5", "--cv", "2"), "--requests, --cv"),
        ("sim", ("--arrival", "gamma"), "--arrival"),
        ("sim", ("--burst-size", "4"), "--burst-size"),
        ("sweep", ("--rates", "2,4,8"), "--rates"),
        ("sweep", ("--requests", "5"), "--requests"),
    ],
)
def test_an_option_that_draws_a_workload_is_refused_with_a_trace(
    tmp_path: Path, command: str, options: tuple[str, ...], named: str
) -> None:
    """They were ignored in silence, and the JSON recorded them as the run's settings."""
    trace, j = tmp_path / "t.jsonl", tmp_path / "r.json"
    assert _invoke(*SIM, "--save-trace", str(trace))[0] == 0
    cli_refused(
        command, "--workload", str(trace), *options, "--json", str(j),
        names=f"{named}: a trace file brings its own requests and arrival times",
    )  # fmt: skip
    assert not j.exists()


def test_a_replayed_trace_records_no_drawing_options(tmp_path: Path) -> None:
    trace, j = tmp_path / "t.jsonl", tmp_path / "r.json"
    assert _invoke(*SIM, "--save-trace", str(trace))[0] == 0
    assert _invoke("sim", "--workload", str(trace), "--json", str(j))[0] == 0
    spec = json.loads(j.read_text())["spec"]
    assert [spec[k] for k in ("requests", "rate", "arrival", "cv", "burst_size")] == [None] * 5
    assert spec["workload"] == str(trace)


@pytest.mark.parametrize("rate", ["1e-20", "1e-100"])
def test_a_rate_too_low_to_time_is_refused(rate: str) -> None:
    """--rate 1e-100 hung in the decode loop; 1e-20 reported 0 s latencies."""
    cli_refused(*SIM[:-2], "--rate", rate, names="raise the arrival rate")


def test_the_simulator_refuses_a_job_past_the_time_it_can_keep() -> None:
    from duetime.core.cost import LinearStepCost
    from duetime.core.request import Job, Request
    from duetime.policies import make_policy
    from duetime.sim import SimConfig, Simulator
    from duetime.sim.simulator import SimulationError

    job = Job(Request(rid=7, arrival=1e20, prompt_len=4), output_len=2)
    sim = Simulator(make_policy("fcfs"), LinearStepCost(c0=0.01), SimConfig())
    with pytest.raises(SimulationError, match="request 7 arrives"):
        sim.run([job])


def test_a_run_too_large_for_memory_is_an_error_line() -> None:
    cli_refused(
        "sim", "--workload", "synthetic", "--requests", "1000000000000", names="out of memory"
    )


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"coefficients": {"c0": 1e-320, "b": 0.0}}, "c0 + b"),  # an OverflowError traceback
        ({"coefficients": {"c0": True}}, "['c0']"),  # read as 1.0
        ({"coefficients": {"b": "0.01"}}, "['b']"),
        ({"kv_capacity_tokens": 1.7}, "kv_capacity_tokens must be an integer"),  # read as 1
        ({"max_num_seqs": "64"}, "max_num_seqs must be an integer"),
        ({"max_batch_tokens": True}, "max_batch_tokens must be an integer"),
    ],
)
def test_a_profile_field_of_the_wrong_kind_is_refused(
    tmp_path: Path, changes: dict[str, object], names: str
) -> None:
    cli_refused(*SIM, "--profile", _profile(tmp_path, **changes), names=names)


def test_a_binary_profile_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe\x00")
    cli_refused(*SIM, "--profile", str(path), names=f"{path}: not a profile")


def test_an_unknown_workload_lists_the_names(tmp_path: Path) -> None:
    out = cli_refused("sim", "--workload", "sharegtp", names="unknown workload 'sharegtp'")
    assert "synthetic" in out


def test_a_tuf_whose_utility_cannot_be_summed_is_refused(tmp_path: Path) -> None:
    line = {"rid": 0, "arrival": 0.0, "prompt_len": 8, "output_len": 4,
            "tuf": {"ert": 0.0, "beta": 1.0, "alpha": -1e308}}  # fmt: skip
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(line) + "\n")
    cli_refused("sim", "--workload", str(trace), names="t.jsonl:1: field 'tuf.alpha'")


def test_demo_refuses_an_unwritable_out_before_running(tmp_path: Path) -> None:
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    out = cli_refused("demo", "--requests", "50", "--out", str(a_file), names="'--out'")
    assert "cannot write" in out
    assert "ShareGPT requests at" not in out  # no table: nothing ran
    assert a_file.read_text() == "x"


def test_the_latency_plot_of_a_run_with_nothing_completed_warns_nothing(tmp_path: Path) -> None:
    from duetime.core.record import RequestRecord
    from duetime.core.request import Request
    from duetime.metrics.run_plot import plot_latency_cdf

    cancelled = RequestRecord(Request(rid=0, arrival=0.0, prompt_len=4), 0.5, cancelled_at=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "No artists with labels found to put in legend"
        path = plot_latency_cdf({"fcfs": [cancelled]}, tmp_path / "p.png")
    assert path.stat().st_size > 0
