"""``duetime bench admission``: one load served per arm, forecast against estimate.

The arms vary the admission mode, where lengths come from (served answers or the
predictor), the confidence and the bursts expected; they are named by what varies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duetime.core.request import Job, LengthPrediction


# --- `duetime bench admission` -------------------------------------------------------
def test_bench_admission_serves_one_load_per_mode(tmp_path: Path) -> None:
    """A short overload of the tiny model: both modes run the same requests, their
    figures (units in the names) in the JSON, the forecast's error only for it."""
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "admission.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "0.5", "--max-tokens", "16", "--max-context", "150"]
    args += ["--predictor", "none", "--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    forecast, estimate = fig["summary"]["forecast"], fig["summary"]["estimate"]
    assert forecast["sent"] == estimate["sent"] > 10
    assert forecast["errors"] == 0 == estimate["errors"]
    assert forecast["accepted"] + forecast["rejected"] == forecast["sent"]
    assert forecast["forecast_ms_p50"] is not None
    assert estimate["forecast_ms_p50"] is None
    assert forecast["forecast_over_actual_p50"] is not None
    assert estimate["forecast_over_actual_p50"] is None
    assert 0 <= forecast["hit_rate_of_accepted"] <= 1
    assert [r["mode"] for r in fig["runs"]] == ["forecast", "estimate"]
    pairs = fig["runs"][0]["forecast_pairs"]  # each forecast beside what the request lived
    assert len(pairs) == fig["runs"][0]["with_forecast"] >= 1
    assert all(p["predicted_e2e_ms"] > 0 and p["e2e_ms"] > 0 for p in pairs)
    assert [p["arrival_s"] for p in pairs] == sorted(p["arrival_s"] for p in pairs)
    assert "goodput_met_req_s_forecast_vs_estimate" in fig["ratios"]
    assert "hit_rate_of_accepted" in res.output


def test_bench_admission_compares_served_lengths_with_the_predictors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request asks for 16 tokens (``--fixed-max-tokens``), which the tiny model
    nearly always writes, and the predictor says 2: the arm whose lengths the served
    answers correct is nearer the truth than the one taking the predictor's word."""
    from typer.testing import CliRunner

    from duetime.cli import app

    class TwoTokens:
        name = "two"

        def predict_job(self, job: Job) -> LengthPrediction:
            return LengthPrediction(point=2.0, lo=1.0, hi=3.0, confidence=0.9)

    monkeypatch.setattr("duetime.server.build._predictor", lambda _options: TwoTokens())
    path = tmp_path / "lengths.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "5", "--max-tokens", "64", "--max-context", "150", "--modes"]
    args += ["forecast", "--lengths", "served,predictor", "--fixed-max-tokens", "16"]
    args += ["--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    fig = json.loads(path.read_text())
    assert fig["fixed_max_tokens"] == 16
    served, raw = fig["summary"]["served"], fig["summary"]["predictor"]  # only lengths vary
    assert [r["arm"] for r in fig["runs"]] == ["served", "predictor"]
    assert served["sent"] == raw["sent"] > 10
    assert raw["length_mae_tokens"] > served["length_mae_tokens"]
    assert "goodput_met_req_s_served_vs_predictor" in fig["ratios"]


def test_bench_admission_with_ignore_eos_knows_every_length(tmp_path: Path) -> None:
    """Every answer runs to its max_tokens: the forecasts' lengths are exact."""
    from typer.testing import CliRunner

    from duetime.cli import app

    path = tmp_path / "eos.json"
    args = ["bench", "admission", "--model", "tiny", "--rate", "20", "--duration", "2"]
    args += ["--deadline", "5", "--max-tokens", "64", "--max-context", "150", "--modes"]
    args += ["forecast", "--fixed-max-tokens", "24", "--ignore-eos", "--predictor", "none"]
    args += ["--threads", "1", "--json", str(path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "ignore-EOS" in res.output
    fig = json.loads(path.read_text())
    assert fig["ignore_eos"] is True
    pairs = fig["runs"][0]["forecast_pairs"]
    assert pairs
    assert {p["answer_tokens"] for p in pairs} == {24}


def test_bench_admission_refuses_an_unknown_mode_before_loading() -> None:
    from tests.factories import cli_refused

    cli_refused("bench", "admission", "--model", "tiny", "--modes", "guess", names="--modes")
    cli_refused("bench", "admission", "--model", "tiny", "--lengths", "guess", names="--lengths")
    cli_refused(
        "bench", "admission", "--model", "tiny", "--confidences", "x", names="--confidences"
    )
    cli_refused("bench", "admission", "--model", "tiny", "--confidences", "1.5", names="(0, 1)")
    bench = ("bench", "admission", "--model", "tiny")
    cli_refused(*bench, "--burst-gaps", "soon", names="--burst-gaps")
    cli_refused(*bench, "--burst-gaps", "-5", names="--burst-gaps")
    cli_refused(*bench, "--arrival", "weibull", names="--arrival")
    cli_refused(*bench, "--burst-size", "6", names="for --arrival bursts, not poisson")
    cli_refused(*bench, "--rate", "inf", names="--rate must be > 0 and finite")
    cli_refused(*bench, "--duration", "inf", names="--duration must be > 0 and finite")
    cli_refused("serve", "--model", "tiny", "--burst-gap-ms", "-1", names="--burst-gap-ms")
    for args in (
        ["--deadline-confidence", "most"],
        ["--admission", "estimate", "--deadline-confidence", "0.9"],
    ):
        cli_refused("serve", "--model", "tiny", *args, names="--deadline-confidence")


def test_bench_admission_names_a_duration_no_request_arrives_in() -> None:
    """At 0.01/s the first Poisson arrival is far past one second: the run says so,
    where it failed on an empty load with the load generator's own words."""
    from tests.factories import cli_refused

    cli_refused(
        *("bench", "admission", "--model", "tiny", "--rate", "0.01", "--duration", "1"),
        *("--predictor", "none", "--threads", "1"),
        names="no request arrives within --duration 1 s at --rate 0.01/s",
    )


def test_bench_admission_names_its_arms_by_what_varies() -> None:
    from duetime.bench.admission import AdmissionBenchConfig, _ratios, arms_of

    conf = arms_of(AdmissionBenchConfig(modes=["forecast"], confidences=[None, 0.95]))
    assert list(conf) == ["plain", "conf0.95"]
    summary = {"plain": {"goodput_met_req_s": 2.0}, "conf0.95": {"goodput_met_req_s": 1.5}}
    assert _ratios(summary, conf) == {"goodput_met_req_s_conf0.95_vs_plain": 0.75}
    both = AdmissionBenchConfig(lengths=["served", "predictor"])
    arms = arms_of(both)
    assert list(arms) == [
        "forecast+served",
        "forecast+predictor",
        "estimate+served",
        "estimate+predictor",
    ]
    summary = {name: {"hit_rate_of_accepted": 1.0 + k} for k, name in enumerate(arms)}
    assert set(_ratios(summary, arms)) == {
        "hit_rate_of_accepted_forecast_vs_estimate_served",
        "hit_rate_of_accepted_forecast_vs_estimate_predictor",
        "hit_rate_of_accepted_served_vs_predictor_forecast",
        "hit_rate_of_accepted_served_vs_predictor_estimate",
    }
    assert list(arms_of(AdmissionBenchConfig())) == ["forecast", "estimate"]
    # a confidence stretches forecasts only: the estimate runs once, compared with each
    mixed = arms_of(AdmissionBenchConfig(confidences=[None, 0.95]))
    assert list(mixed) == ["forecast+plain", "forecast+conf0.95", "estimate"]
    summary = {name: {"goodput_met_req_s": 1.0 + k} for k, name in enumerate(mixed)}
    assert set(_ratios(summary, mixed)) == {
        "goodput_met_req_s_forecast_vs_estimate_plain",
        "goodput_met_req_s_forecast_vs_estimate_conf0.95",
        "goodput_met_req_s_conf0.95_vs_plain_forecast",
    }
    # so do the bursts a forecast expects (0: none, "even")
    bursts = arms_of(AdmissionBenchConfig(burst_gaps=[0.05, 0.0]))
    assert list(bursts) == ["forecast+bursts50ms", "forecast+even", "estimate"]
    assert (bursts["forecast+even"].burst_gap_s, bursts["estimate"].burst_gap_s) == (0.0, 0.0)
    summary = {name: {"goodput_met_req_s": 1.0 + k} for k, name in enumerate(bursts)}
    assert _ratios(summary, bursts) == {
        "goodput_met_req_s_forecast_vs_estimate_bursts50ms": 1 / 3,
        "goodput_met_req_s_forecast_vs_estimate_even": 2 / 3,
        "goodput_met_req_s_bursts50ms_vs_even_forecast": 1 / 2,
    }
