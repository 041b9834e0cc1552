"""`duetime bench sensitivity`: structure, and that prediction error hurts a predictive policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.bench import sensitivity
from duetime.cli import app


def test_fcfs_ignores_the_predictor_and_sjf_does_not() -> None:
    fig = sensitivity.run(["fcfs", "sjf"], [0.0, 1.0], requests=300, rate=20.0, kv_capacity=20_000)
    by = {(r["policy"], r["prediction_error_sigma"]): r for r in fig["rows"]}
    assert by[("fcfs", 0.0)]["tel_s"] == by[("fcfs", 1.0)]["tel_s"]  # reads no prediction
    assert by[("sjf", 1.0)]["tel_s"] > by[("sjf", 0.0)]["tel_s"]  # noise breaks its order
    for r in fig["rows"]:
        assert 0.0 <= r["deadline_hit_rate"] <= 1.0


def test_cli_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    args = ["bench", "sensitivity", "--policies", "fcfs,amax", "--errors", "0,0.5"]
    args += ["--requests", "100", "--json", str(out), "--plot", str(png), "--learned", "none"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(json.loads(out.read_text())["rows"]) == 4
    assert png.stat().st_size > 0
    bad = CliRunner().invoke(app, ["bench", "sensitivity", "--errors", "a,b"])
    assert bad.exit_code == 2
    neg = CliRunner().invoke(app, ["bench", "sensitivity", "--errors", "-1", "--requests", "5"])
    assert neg.exit_code == 2
    typo = CliRunner().invoke(app, ["bench", "sensitivity", "--learned", "lerned"])
    assert typo.exit_code == 2
    assert "--learned" in typo.output


def test_learned_predictor_sits_at_its_effective_sigma() -> None:
    fig = sensitivity.run(["fcfs", "sjf"], [0.0], requests=150, learned="learned")
    sigma = fig["learned_effective_sigma"]
    learned = [r for r in fig["rows"] if r["predictor"] == "learned"]
    assert [r["policy"] for r in learned] == ["fcfs", "sjf"]
    # ShareGPT lengths are barely predictable from the prompt: far from the oracle.
    assert 0.3 < sigma < 3.0
    assert all(r["prediction_error_sigma"] == sigma for r in learned)
    oracle_sjf = next(r for r in fig["rows"] if r["policy"] == "sjf" and r["predictor"] == "oracle")
    assert learned[1]["tel_s"] != oracle_sjf["tel_s"]  # sjf reads the learned predictions


def test_effective_sigma_needs_predictions() -> None:
    from duetime.core.request import Job, Request

    with pytest.raises(ValueError, match="no job carries a prediction"):
        sensitivity.effective_sigma([Job(Request(rid=0, arrival=0.0, prompt_len=4), 3)])


def test_heldout_workload_draws_only_rows_no_shipped_predictor_trained_on() -> None:
    import numpy as np

    from duetime.predict.length_data import heldout_rows
    from duetime.predict.length_fit import SHIPPED_MODELS, shipped_model_path
    from duetime.predict.length_model import LengthModel
    from duetime.workloads import LengthCaps, ShareGPTSource, load_sharegpt_lengths

    lengths = load_sharegpt_lengths(progress=False)
    rows = heldout_rows(lengths)
    for name in SHIPPED_MODELS:  # the shipped models were tested on exactly these rows
        meta = LengthModel.load(shipped_model_path(name)).meta
        assert meta["split_sizes"]["test"] == len(rows)
    sample = ShareGPTSource(lengths, pool=rows).sample(
        500, np.random.default_rng(0), LengthCaps(max_total_len=4096)
    )
    assert sample.rows is not None
    assert np.isin(sample.rows, rows).all()
    anywhere = ShareGPTSource(lengths).sample(
        500, np.random.default_rng(0), LengthCaps(max_total_len=4096)
    )
    assert not np.isin(anywhere.rows, rows).all()  # without the pool, training rows come too


def test_runs_that_completed_unalike_are_named_beside_their_tel(tmp_path: Path) -> None:
    """TimeBill kills what it cannot finish in time: under tight deadlines it completes a
    fifth of the requests and so sums a far smaller TEL than FCFS, which completes them
    all. The command says so; runs that completed alike get no note."""
    args = ["bench", "sensitivity", "--policies", "fcfs,timebill", "--errors", "0"]
    args += ["--requests", "200", "--deadline-scale", "2", "--learned", "none"]
    res = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "note: completion_rate runs from 0.2" in text
    assert "(timebill, σ=0) to 1.000 (fcfs, σ=0)" in text
    fig = sensitivity.run(["fcfs"], [0.0, 1.0], requests=100)
    assert sensitivity.completion_note(fig) is None
