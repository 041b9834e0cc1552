"""The command line: happy paths write what they promise, bad input exits 2 with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.output


def test_sim_synthetic_writes_json_and_plot(tmp_path: Path) -> None:
    j, p = tmp_path / "r.json", tmp_path / "r.png"
    code, output = _invoke(
        "sim", "--workload", "synthetic", "--requests", "300", "--rate", "20",
        "--policy", "edf", "--deadline-scale", "5", "--json", str(j), "--plot", str(p),
    )  # fmt: skip
    assert code == 0, output
    payload = json.loads(j.read_text())
    assert payload["summary"]["requests"] == 300
    assert payload["summary"]["completed"] == 300
    assert payload["spec"]["policy"] == "edf"
    assert 0.0 <= payload["summary"]["deadline_hit_rate"] <= 1.0
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_trace_then_replay_gives_the_same_result(tmp_path: Path) -> None:
    trace, a, b = tmp_path / "t.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    drawn = ["--requests", "150", "--rate", "10"]  # a trace brings its own
    code, out = _invoke("sim", "--workload", "synthetic", *drawn, "--policy", "fcfs",
                        "--save-trace", str(trace), "--json", str(a))  # fmt: skip
    assert code == 0, out
    code, out = _invoke("sim", "--workload", str(trace), "--policy", "fcfs", "--json", str(b))
    assert code == 0, out
    sa, sb = json.loads(a.read_text())["summary"], json.loads(b.read_text())["summary"]
    assert sa["e2e_mean_s"] == pytest.approx(sb["e2e_mean_s"], rel=1e-9)


def test_bad_trace_line_exits_2_naming_line_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"rid": 0, "arrival": 0.0, "prompt_len": 10, "output_len": 5}\n'
        '{"rid": 1, "arrival": 0.5, "prompt_len": -3, "output_len": 5}\n'
    )
    code, output = _invoke("sim", "--workload", str(trace))
    assert code == 2
    assert "bad.jsonl:2" in output
    assert "prompt_len" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "nope"], "known policies"),
        (["--profile", "nope"], "unknown profile"),
        (["--arrival", "weibull"], "unknown arrival"),
        (["--burst-size", "3"], "for --arrival bursts, not poisson"),
        # recorded as the run's, and changed nothing
        (["--cv", "2"], "is for --arrival gamma, not poisson"),
        # np.repeat sized memory by the burst: an OverflowError traceback past int64
        (
            ["--arrival", "bursts", "--burst-size", "99999999999999999999"],
            "holds more than the 10 requested",
        ),
        (["--workload", "/does/not/exist.jsonl"], "exist.jsonl"),
        (["--predictor", "psychic"], "unknown predictor"),
        # the caps it spoke of were what the prefix left, and it did not say so
        (["--shared-prefix", "4000"], "the context less the 4,000-token --shared-prefix"),
    ],
)
def test_bad_options_exit_2(args: list[str], needle: str) -> None:
    code, output = _invoke("sim", "--requests", "10", "--workload", "synthetic", *args)
    assert code == 2, output
    assert needle in output
    assert "Traceback" not in output


def test_profile_file_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"coefficients": {"c0": -1}}')
    code, output = _invoke("sim", "--requests", "10", "--workload", "synthetic",
                           "--profile", str(bad))  # fmt: skip
    assert code == 2
    assert "c0" in output


def test_sweep_process_pool_rows_and_plot(tmp_path: Path) -> None:
    j, p = tmp_path / "s.json", tmp_path / "s.png"
    code, output = _invoke(
        "sweep", "--policies", "fcfs,edf", "--rates", "5,20", "--seeds", "0,1",
        "--workload", "synthetic", "--requests", "200", "--deadline-scale", "4",
        "--workers", "2", "--json", str(j), "--plot", str(p),
    )  # fmt: skip
    assert code == 0, output
    rows = json.loads(j.read_text())["rows"]
    assert len(rows) == 8
    assert {(r["policy"], r["rate_req_s"], r["seed"]) for r in rows} == {
        (pol, rate, s) for pol in ("fcfs", "edf") for rate in (5.0, 20.0) for s in (0, 1)
    }
    # higher load, higher latency: a sweep that could not show this would be broken
    fcfs = {
        r["rate_req_s"]: r["e2e_mean_s"] for r in rows if r["policy"] == "fcfs" and r["seed"] == 0
    }
    assert fcfs[20.0] > fcfs[5.0]
    assert p.stat().st_size > 10_000


def test_sweep_predictor_reaches_every_run(tmp_path: Path) -> None:
    """``--predictor`` applies to each policy; 'policy' keeps each one's own default."""
    j = tmp_path / "s.json"
    rows = {}
    for predictor in ("none", "oracle"):
        code, output = _invoke(
            "sweep", "--policies", "spf", "--rates", "30", "--workload", "synthetic",
            "--requests", "300", "--workers", "1", "--predictor", predictor, "--json", str(j),
        )  # fmt: skip
        assert code == 0, output
        (row,) = json.loads(j.read_text())["rows"]
        assert row["predictor"] == predictor
        rows[predictor] = row
    # shortest-predicted-first with no prediction is FCFS; with the truth it is SJF
    assert rows["oracle"]["e2e_mean_s"] < rows["none"]["e2e_mean_s"]


def test_sweep_on_local_ray() -> None:
    ray = pytest.importorskip("ray")
    from duetime.experiment import SimSpec
    from duetime.sweep import run_sweep

    specs = [
        SimSpec(policy=p, workload="synthetic", requests=100, rate=10) for p in ("fcfs", "edf")
    ]
    try:
        rows = run_sweep(specs, workers=2, backend="ray")
    finally:
        ray.shutdown()
    serial = run_sweep(specs, backend="serial")
    assert [r["e2e_mean_s"] for r in rows] == [r["e2e_mean_s"] for r in serial]


def test_policies_and_profiles_list() -> None:
    code, output = _invoke("policies")
    assert code == 0
    assert {"fcfs", "edf", "sjf", "spf"} <= set(output.split())
    code, output = _invoke("profiles")
    assert "a100-llama2-7b" in output


def test_engine_commands_refuse_bad_input_with_exit_2(tmp_path: Path) -> None:
    code, output = _invoke("validate", "--profile", str(tmp_path / "missing.json"))
    assert code == 2
    assert "duetime profile" in output
    code, output = _invoke("validate", "--profile", "a100-llama2-7b")  # not this engine's
    assert code == 2
    assert "shipped profile of another machine" in " ".join(output.split())
    code, output = _invoke("profile", "--dtype", "fp64", "--out", str(tmp_path / "p.json"))
    assert code == 2
    assert "fp64" in output
    assert not (tmp_path / "p.json").exists()


def test_version_prints_the_package_version_and_runs_nothing() -> None:
    from importlib.metadata import version

    code, output = _invoke("--version")
    assert code == 0, output
    assert output.strip() == f"duetime {version('duetime')}"
    code, output = _invoke("--version", "sim", "--rate", "-1")  # eager: the command never runs
    assert (code, output.strip()) == (0, f"duetime {version('duetime')}")


@pytest.mark.parametrize("command", ["policies", "routers", "profiles"])
def test_a_listing_names_each_entry_with_what_it_is(command: str) -> None:
    """The listings were bare names: a reader had to open the docs to choose one."""
    from duetime.policies import available_policies
    from duetime.routers import available_routers
    from duetime.sim.profiles import builtin_profiles

    names = {"policies": available_policies, "routers": available_routers}.get(
        command, builtin_profiles
    )()
    code, output = _invoke(command)
    assert code == 0, output
    lines = output.splitlines()
    assert [line.split()[0] for line in lines] == names  # the name first, for scripts
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # each described
