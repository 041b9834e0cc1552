"""`duetime profile --samples`: every timed step written as telemetry-shaped JSON lines
that load back (``steps_from_telemetry``) and refit to the profile's own coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.engine.step_samples import steps_from_telemetry, write_steps
from duetime.predict.ete import StepSample, fit_batch_cost
from tests.factories import cli_refused


def test_profile_samples_load_back_and_refit_to_the_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import duetime.engine
    from duetime.engine.cost_regimes import attention_shape_of, regimes_of
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    model = engine_from_hf(tiny_hf_model())
    monkeypatch.setattr(duetime.engine, "load_model", lambda **kw: model)
    out, steps, report = tmp_path / "p.json", tmp_path / "s.jsonl", tmp_path / "r.json"
    png = tmp_path / "fit.png"
    res = CliRunner().invoke(app, [
        "profile", "--quick", "--serve-requests", "2", "--threads", "1", "--out", str(out),
        "--samples", str(steps), "--json", str(report), "--plot", str(png),
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    rep = json.loads(report.read_text())
    assert len(rows) == rep["samples"]
    assert [r["source"] for r in rows].count("grid") == rep["grid_samples"]
    assert [r["source"] for r in rows].count("serving") == rep["serving_samples"] > 0
    back = steps_from_telemetry(steps)
    assert [s.kind for s in back] == [r["kind"] for r in rows]
    profile = json.loads(out.read_text())
    # each prompt step keeps its chunks, from which its A was counted as the model's
    # kernels count it: the shape the profile carries, so an offline refit can recount
    shape = attention_shape_of(model)
    assert profile["attention"] == rep["attention"] == shape.as_dict()
    assert f"{shape.sliding_layers} of {shape.layers} layers" in res.output
    prompts = [s for s in back if s.prefill_tokens]
    assert prompts
    assert all(sum(r for r, _ in s.chunks) == s.prefill_tokens for s in prompts)
    for s in prompts:
        assert s.prefill_attn == pytest.approx(sum(shape.work(r, e) for r, e in s.chunks))
    refit = fit_batch_cost(back, name=profile["name"], regimes=regimes_of(model))
    for k, v in refit.to_profile()["coefficients"].items():
        if k == "e":  # fitted from the timed evictions, which are not steps
            continue
        assert v == pytest.approx(profile["coefficients"][k], rel=1e-9, abs=1e-15), k


def test_write_steps_refuses_a_source_list_of_another_length(tmp_path: Path) -> None:
    s = StepSample(8, 64.0, 0, 0, 0.01, "prefill")
    with pytest.raises(ValueError, match="2 sources for 1 samples"):
        write_steps(tmp_path / "s.jsonl", [s], ["grid", "grid"])
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("option", ["--samples", "--plot"])
def test_samples_and_plot_are_refused_with_a_url(tmp_path: Path, option: str) -> None:
    cli_refused("profile", "--url", "http://127.0.0.1:9", option, str(tmp_path / "x"),
                names="not with --url")  # fmt: skip


def test_a_plot_of_no_steps_is_refused(tmp_path: Path) -> None:
    from duetime.core.cost import LinearStepCost
    from duetime.predict.cost_plot import plot_step_fit

    with pytest.raises(ValueError, match="no timed steps"):
        plot_step_fit(LinearStepCost(c0=0.001), [], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()
