"""Refusals that name the option (or file) at fault in the command line's own terms,
help that agrees with the checks, and a sweep plot with a line per fleet."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from duetime.cli import app
from tests.factories import cli_refused

runner = CliRunner()
SIM = ("sim", "--workload", "synthetic", "--requests", "5")
RATE_WORDS = "must be > 0 requests/s (inf: everything at the start)"


def _help(*command: str) -> str:
    res = runner.invoke(app, [*command, "--help"])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def _params(name: str) -> dict[str, Any]:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return {p.name: p for p in commands[name].params if p.name}


# --- arrival rate and gamma cv ----------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        ((*SIM, "--rate", "0"), "--rate", "got 0"),
        ((*SIM, "--rate", "nan"), "--rate", "got nan"),
        (("demo", "--rate", "-5"), "--rate", "got -5"),
        (("sweep", "--rates", "4,0", "--workload", "synthetic"), "--rates", "got 0"),
        (("sweep", "--rates", "nan", "--workload", "synthetic"), "--rates", "got nan"),
        (("validate", "--rate", "0"), "--rate", "got 0"),
    ],
)
def test_a_rate_that_is_no_rate_is_named(args: tuple[str, ...], option: str, value: str) -> None:
    out = cli_refused(*args, names=f"{option} {RATE_WORDS}", value=value)
    assert "math.inf" not in out


@pytest.mark.parametrize("cv", ["0", "nan", "2000"])
def test_a_gamma_cv_out_of_bounds_names_the_option(cv: str) -> None:
    cli_refused(*SIM, "--arrival", "gamma", "--cv", cv, names="--cv must be", value=f"got {cv}")


@pytest.mark.parametrize("command", ["sim", "sweep", "demo", "validate"])
def test_help_shows_no_bound_the_check_contradicts(command: str) -> None:
    text = _help(command)
    assert "x>=0.0" not in text
    assert "requests/s" in text


def test_cv_help_gives_the_bounds_the_check_uses() -> None:
    from duetime.workloads.arrivals import CV_MAX, CV_MIN

    assert f"{CV_MIN:g} to {CV_MAX:g}" in _help("sim")
    assert math.isinf(float("inf"))  # inf is a rate: every request at the start
    res = runner.invoke(app, [*SIM, "--rate", "inf"])
    assert res.exit_code == 0, res.output


# --- workloads ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["missing.jsonl", "sub/trace"])
def test_a_missing_trace_file_is_said_not_to_exist(tmp_path: Path, name: str) -> None:
    out = cli_refused("sim", "--workload", str(tmp_path / name), names="does not exist")
    assert "unknown workload" not in out


def test_a_name_that_is_no_path_is_still_an_unknown_workload() -> None:
    cli_refused("sim", "--workload", "sharegtp", names="unknown workload 'sharegtp'")


def test_a_shared_prefix_past_the_context_is_refused_up_front() -> None:
    out = cli_refused("sim", "--shared-prefix", "5000", "--requests", "20", names="(5,000 tokens)")
    assert "4,096-token context" in out
    assert "-903" not in out


def test_a_shared_prefix_without_room_is_refused_by_the_builder() -> None:
    from duetime.workloads import LengthCaps, SharedPrefix

    with pytest.raises(ValueError, match="leaves no room"):
        SharedPrefix(5000).caps_for_rest(LengthCaps(max_total_len=4096))
    assert SharedPrefix(100).caps_for_rest(LengthCaps(max_total_len=4096)).max_total_len == 3997


# --- sweep lists, fleet files ------------------------------------------------------------
def test_sweep_names_the_list_that_is_bad() -> None:
    out = cli_refused("sweep", "--rates", "4,abc", names="--rates", value="'abc'")
    assert "--seeds" not in out
    out = cli_refused("sweep", "--seeds", "0,x", names="--seeds", value="'x'")
    assert "--rates" not in out


@pytest.mark.parametrize("slowdown", [-1, 0])
def test_a_bad_fleet_slowdown_names_the_file_and_group(tmp_path: Path, slowdown: int) -> None:
    fleet = tmp_path / "f.json"
    groups = [{"profile": "a100-llama2-7b"}, {"profile": "a100-llama2-7b", "slowdown": slowdown}]
    fleet.write_text(json.dumps({"replicas": groups}))
    cli_refused(*SIM, "--fleet", str(fleet), names=f"--fleet {fleet}, replicas[1]: slowdown")


# --- validate, bench fleet ----------------------------------------------------------------
def test_validate_checks_dtype_before_the_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from duetime.sim.profiles import profile_path
    from tests.factories import forbid_model_loads

    forbid_model_loads(monkeypatch)
    profile = json.loads(profile_path("a100-llama2-7b").read_text())
    profile["engine"] = {"dtype": "q8", "threads": 2}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    out = cli_refused("validate", "--profile", str(path), "--dtype", "bogus", names="--dtype")
    assert "must be one of fp32" in out
    assert "duetime profile" not in out


@pytest.mark.parametrize("loads", ["200", "0.85", "nan", "85,x"])
def test_bench_fleet_loads_are_percentages(loads: str) -> None:
    cli_refused("bench", "fleet", "--loads", loads, names="--loads", value="percentages")


def test_bench_fleet_help_and_check_use_one_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    import duetime.bench.fleet

    assert "% of the fleet's capacity" in _help("bench", "fleet")
    seen: dict[str, Any] = {}

    def run(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"capacity_req_s": {}, "rows": []}

    monkeypatch.setattr(duetime.bench.fleet, "run", run)
    res = runner.invoke(app, ["bench", "fleet", "--loads", "85,1,199.5"])
    assert res.exit_code == 0, res.output
    assert seen["loads"] == pytest.approx([0.85, 0.01, 1.995])


# --- help text ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("profile", {"max_num_seqs": "requests", "max_batch_tokens": "tokens"}),
        (
            "validate",
            {
                "policy": "policy",
                "rate": "requests/s",
                "seed": "seed",
                "max_prompt": "tokens",
                "max_output": "tokens",
                "json_path": "JSON",
                "plot": "PNG",
            },
        ),
        ("demo", {"requests": "requests", "rate": "requests/s"}),
    ],
)
def test_options_have_help_with_units(command: str, words: dict[str, str]) -> None:
    params = _params(command)
    for name, word in words.items():
        text = getattr(params[name], "help", None) or ""
        assert word.lower() in text.lower(), f"{command} {name}: {text!r}"


# --- advise deferred-prefill ----------------------------------------------------------------
def test_advise_deferred_prefill_prints_no_nan() -> None:
    res = runner.invoke(
        app, ["advise", "deferred-prefill", "--capacity", "1", "--mean-output", "250"]
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "nan" not in text.lower()
    # Proposition 1 needs a K < C: it printed "predicts ρ(K*) = 0.000 req/s" here
    assert "approximation (Prop. 1): undefined at C = 1 (it needs a K < C)" in text
    assert "0.000 req/s" not in text
    res = runner.invoke(
        app, ["advise", "deferred-prefill", "--capacity", "64", "--mean-output", "250"]
    )
    assert "no gain to report" not in res.output
    assert "% vs K = 1" in res.output


@pytest.mark.parametrize("coverage", ["1.5", "0", "nan"])
@pytest.mark.parametrize(
    "command",
    [
        ("predict", "throughput", "--input-len", "8", "--output-len", "8", "--batch", "2"),
        ("bench", "predict-length"),
    ],
)
def test_coverage_is_named_where_it_is_checked(coverage: str, command: tuple[str, ...]) -> None:
    """'coverage must be in (0, 1)' named no option: the model's own check spoke."""
    res = runner.invoke(app, [*command, "--coverage", coverage])
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--coverage': must be in (0, 1)" in res.output
