"""The Amin and deferred-prefill benchmarks at toy scale: they write what they promise."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from typer.testing import CliRunner

from duetime.cli import app

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_amin_small(tmp_path: Path) -> None:
    j, p = tmp_path / "a.json", tmp_path / "a.png"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "amin",
            "--requests",
            "40",
            "--kv-capacity",
            "8000",
            "--workers",
            "1",
            "--no-two-point",
            "--json",
            str(j),
            "--plot",
            str(p),
        ],
    )
    assert r.exit_code == 0, r.output
    fig = json.loads(j.read_text())
    assert p.read_bytes()[:8] == PNG
    rows = fig["rows"]
    # H-SF per setting and job set (all rows; the learned predictor's held-out rows), then
    # Amax / Amin per setting × construction (the paper's five and the learned one)
    assert len(rows) == 2 * 2 + 2 * 2 * 6
    assert all(row["completed"] == 40 for row in rows)
    assert {row["tel_ratio_vs_hsf"] for row in rows if row["policy"] == "hsf"} == {1.0}
    learned = [row for row in rows if row["construction"] == "learned"]
    assert {row["policy"] for row in learned} == {"hsf", "amax", "amin"}
    assert fig["learned_predictors"] == ["learned"]
    stats = fig["learned_intervals"]["learned"]
    assert stats["requests"] == 40
    assert 0.5 < stats["coverage"] <= 1.0
    assert 0.0 < stats["alpha_median"] < 1.0
    assert "overlap-0.99" in r.output
    assert "held-out requests" in r.output
    assert "LMSYS" in r.output


def _amin(tmp_path: Path, *extra: str) -> tuple[object, dict | None]:
    j = tmp_path / "a.json"
    args = ["bench", "amin", "--requests", "12", "--kv-capacity", "8000", "--workers", "1"]
    r = CliRunner().invoke(app, [*args, "--no-two-point", *extra, "--json", str(j)])
    return r, json.loads(j.read_text()) if j.exists() else None


def test_bench_amin_runs_each_learned_predictor_named_and_none(tmp_path: Path) -> None:
    r, fig = _amin(
        tmp_path, "--learned", "learned,learned:minilm-ft", "--plot", str(tmp_path / "a.png")
    )
    assert r.exit_code == 0, r.output
    assert fig["learned_predictors"] == ["learned", "learned:minilm-ft"]
    for spec in fig["learned_predictors"]:
        policies = {row["policy"] for row in fig["rows"] if row["construction"] == spec}
        assert policies - {"hsf"} == {"amax", "amin"}  # (H-SF's held-out rows are "learned")
        assert fig["learned_intervals"][spec]["requests"] == 12
        assert f"{spec} intervals on 12 held-out requests" in r.output
    # both against one H-SF run on the held-out rows, per setting
    hsf = [row for row in fig["rows"] if row["policy"] == "hsf" and row["construction"] != "oracle"]
    assert len(hsf) == 2
    r, fig = _amin(tmp_path, "--learned", "", "--plot", str(tmp_path / "b.png"))
    assert r.exit_code == 0, r.output
    assert fig["learned_predictors"] == []
    assert not any(row["construction"].startswith("learned") for row in fig["rows"])


def test_bench_amin_refuses_a_predictor_that_is_not_learned_before_running(tmp_path) -> None:
    for spec, why in (("oracle", "is not learned"), ("learned:nope.npz", "nor a model file")):
        r, fig = _amin(tmp_path, "--learned", spec)
        assert r.exit_code != 0
        assert why in r.output
        assert fig is None


def test_learned_intervals_are_judged_on_rows_the_predictor_never_saw() -> None:
    from duetime import workloads as wl
    from duetime.bench.amin import MAX_OUTPUT, heldout_jobs
    from duetime.predict.length_data import heldout_rows
    from duetime.predict.length_features import sharegpt_prompts

    lengths = wl.load_sharegpt_lengths(progress=False)
    prompts = sharegpt_prompts(lengths)
    unseen = Counter(prompts[i] for i in heldout_rows(lengths))  # (a prompt may recur)
    jobs = heldout_jobs(10**6, seed=0)  # more than there are: each row once
    drawn = Counter(j.request.prompt_text for j in jobs)
    assert 1000 < len(jobs) <= unseen.total()
    assert all(n <= unseen[text] for text, n in drawn.items())  # no row twice, none seen
    assert all(j.output_len <= MAX_OUTPUT for j in jobs)


def test_bench_deferred_prefill_small(tmp_path: Path) -> None:
    j, p = tmp_path / "d.json", tmp_path / "d.png"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "deferred-prefill",
            "--requests",
            "150",
            "--capacity",
            "12",
            "--workers",
            "1",
            "--json",
            str(j),
            "--plot",
            str(p),
        ],
    )
    assert r.exit_code == 0, r.output
    fig = json.loads(j.read_text())
    assert p.read_bytes()[:8] == PNG
    assert len(fig["analytic"]) == 12
    assert {s["curve"] for s in fig["simulated"]} == {"sim-model", "sim-sharegpt"}
    assert 1 <= fig["advice"]["k_star"] <= 12
    assert fig["real"] is None
    assert "analytic K*" in r.output
