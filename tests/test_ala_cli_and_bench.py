"""ALA: out-of-range shapes, empty data files, repeated configs, rich markup in names,
the fold count, and the bench's ALA + SA column and Table I.

Each test failed on the code before it: an OverflowError traceback for a 20-digit
``--input-len``, a NaN confidence for ``--batch 1e11``, an IndexError for a CSV
with only its header, twelve duplicate rows for ``--config X --config X``, a
config name eaten as markup, "5 folds" with three pairs, an ALA + SA column
trained without the validation pairs, and a Table I row scored in-sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.predict import ala_data
from duetime.predict.ala_collect import Grid, collect
from duetime.predict.ala_curve import curve
from duetime.predict.ala_data import AlaDataError, done_keys, load, read_csv
from duetime.predict.ala_limits import MAX_BATCH, MAX_TOKENS
from duetime.predict.ala_model import AlaModel, AlaPredictor, PointConfidence

from .test_ala import recording_runner

runner = CliRunner()
SMALL = "engine-gemma3-270m-fp32-t1"  # 9 pairs, 90 runs: a predictor in a second


def _invoke(*args: str) -> tuple[int, str, BaseException | None]:
    res = runner.invoke(app, list(args))
    return res.exit_code, " ".join(res.output.replace("│", " ").split()), res.exception


def _synthetic_csv(path: Path, config: str, pairs: int = 3) -> Path:
    """``pairs`` (ii, oo) workloads, 5 batch sizes each, on a known curve."""
    lines = [",".join(ala_data.COLUMNS)]
    for k in range(pairs):
        ii = 16 * 2**k
        for bb in (1, 2, 4, 8, 16):
            thpt = float(curve(np.array([bb]), 90.0 + 10 * k, 0.2, 100.0 + 5 * k)[0])
            lines.append(f"{config},sim,{ii},8,{bb},0,{thpt:.6g},{bb * 8 / thpt:.6g}")
    path.write_text("\n".join(lines) + "\n")
    return path


# --- 1. ranges of ii, oo, bb -----------------------------------------------------------


@pytest.fixture(scope="module")
def small_predictor() -> AlaPredictor:
    return AlaPredictor(ala_data.config_data(SMALL))


@pytest.mark.parametrize(
    ("shape", "what"),
    [
        ((10**20, 8, 1), r"ii \(--input-len\) must be in \[1, 10,000,000\]"),
        ((16, MAX_TOKENS + 1, 1), r"oo \(--output-len\) must be in"),
        ((16, 8, 10**11), r"bb \(--batch\) must be in \[1, 1,000,000\]"),
        ((0, 8, 1), r"ii \(--input-len\)"),
    ],
)
def test_predict_throughput_refuses_shapes_out_of_range(
    small_predictor: AlaPredictor, shape: tuple[int, int, int], what: str
) -> None:
    with pytest.raises(ValueError, match=what):
        small_predictor.predict_throughput(*shape)


def test_predict_throughput_at_the_maxima_is_a_prediction(small_predictor: AlaPredictor) -> None:
    p = small_predictor.predict_throughput(MAX_TOKENS, MAX_TOKENS, MAX_BATCH)
    assert 0 <= p.lo <= p.point <= p.hi < np.inf
    assert 0.5 <= p.confidence <= 1


def test_point_confidence_far_off_the_grid_is_finite() -> None:
    """At bb ~ 5e10 the kernel's squares underflowed: norm 0, a NaN confidence."""
    ii, oo, bb = np.meshgrid([64, 128, 256], [32, 64], [1, 4, 16])
    conf = PointConfidence(ii.ravel(), oo.ravel(), bb.ravel())
    for q in (1e11, 1e30):
        c = conf(128, 64, q)
        assert np.isfinite(c)
        assert 0.5 <= c < 1.0
    assert conf(128, 64, 4) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (
            ["--input-len", "99999999999999999999", "--output-len", "1", "--batch", "1"],
            "--input-len",
        ),
        (["--input-len", "16", "--output-len", "10000001", "--batch", "1"], "--output-len"),
        (["--input-len", "16", "--output-len", "1", "--batch", "100000000000"], "--batch"),
    ],
)
def test_cli_out_of_range_shape_exits_2_naming_the_option(args: list[str], option: str) -> None:
    code, out, exc = _invoke("predict", "throughput", *args)
    assert code == 2, out
    assert isinstance(exc, SystemExit)  # no traceback
    assert option in out
    assert "Traceback" not in out


# --- 2. a data file with no rows ------------------------------------------------------


def test_csv_with_only_a_header_is_refused_where_it_loads(tmp_path: Path) -> None:
    p = tmp_path / "onlyheader.csv"
    p.write_text(",".join(ala_data.COLUMNS) + "\n\n")
    assert read_csv(p) == []  # reading is fine (collection resumes into such a file) ...
    assert done_keys(p) == set()
    with pytest.raises(AlaDataError, match=r"onlyheader\.csv: has no rows"):
        load([p])  # ... loading it to fit a model is not
    for cmd in (
        ["predict", "throughput", "--input-len", "8", "--output-len", "8", "--batch", "1"],
        ["bench", "ala"],
    ):
        code, out, exc = _invoke(*cmd, "--data", str(p))
        assert code == 2, out
        assert isinstance(exc, SystemExit)
        assert "onlyheader.csv: has no rows" in out


# --- 3. a config given twice ---------------------------------------------------------


def test_collect_runs_a_repeated_config_once(tmp_path: Path) -> None:
    calls: list[tuple[int, int, int, int]] = []
    stub = recording_runner(calls)
    path = tmp_path / "c.csv"
    name = "sim-a100-llama2-7b"
    grid = Grid(ii=(16, 16), oo=(4,), bb=(1, 2))  # a repeated grid value runs once too
    counts = collect([name, name], path, grid=grid, runner_factory=stub)
    assert counts["run"] == 2
    assert sorted(calls) == [(16, 4, 1, 0), (16, 4, 2, 0)]
    assert len(read_csv(path)) == 2


def test_cli_collect_with_a_repeated_config_writes_each_key_once(tmp_path: Path) -> None:
    path = tmp_path / "dup.csv"
    name = "sim-a100-llama2-7b"
    code, out, _ = _invoke(
        "predict", "collect-throughput", "--quick", "--config", name, "--config", name,
        "--out", str(path),
    )  # fmt: skip
    assert code == 0, out
    keys = [r.key for r in read_csv(path)]
    assert len(keys) == len(set(keys)) == 12  # the quick grid: 2 ii x 2 oo x 3 bb
    assert "ran 12 shapes" in out


# --- 4. names printed through rich; the fold count ------------------------------------


def test_cli_throughput_prints_a_bracketed_config_name_and_the_real_fold_count(
    tmp_path: Path,
) -> None:
    name = "[bold]gpu[/bold]"
    csv = _synthetic_csv(tmp_path / "b.csv", name, pairs=3)
    res = runner.invoke(
        app,
        ["predict", "throughput", "--input-len", "32", "--output-len", "8", "--batch", "4",
         "--config", name, "--data", str(csv)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"{name}: ii=32")
    text = " ".join(res.output.split())
    assert "(3 folds over (ii, oo) pairs)" in text  # 3 pairs: 3 folds, not "5"


def test_bench_tables_print_a_bracketed_config_name(tmp_path: Path) -> None:
    name = "[red]x[/red]"
    csv = _synthetic_csv(tmp_path / "b.csv", name, pairs=5)
    res = runner.invoke(app, ["bench", "ala", "--data", str(csv), "--sa-iters", "2"])
    assert res.exit_code == 0, res.output
    assert "[red]x[/red]" in res.output  # a table cell
    assert f"SA {name}:" in res.output  # the annealing line


# --- 6, 7. bench ala: ALA + SA comparable with ALA; Table I off the log -----------------


@pytest.fixture(scope="module")
def bench_q8() -> dict[str, object]:
    from duetime.bench.ala import run

    return run(configs=["engine-gemma3-270m-q8-t2"], seed=0, sa_iters=0)


def test_sa_refit_of_the_whole_training_set_is_plain_ala() -> None:
    from duetime.bench.ala import _concat, sa_refit, split_pairs
    from duetime.predict.ala_select import Subset

    data = ala_data.config_data("engine-gemma3-270m-q8-t2")
    train, val, test = split_pairs(data, seed=0)
    plain = AlaModel.fit(_concat(train, val), seed=0).predict(test.ii, test.oo, test.bb)
    full = sa_refit(train, val, Subset.of(train), seed=0).predict(test.ii, test.oo, test.bb)
    assert np.array_equal(plain, full)


def test_bench_sa_column_equals_ala_when_sa_keeps_everything(bench_q8: dict) -> None:
    r = bench_q8["configs"]["engine-gemma3-270m-q8-t2"]
    assert r["sa_best_subset"] == {
        k: sorted(getattr(r["_universe"], k)) for k in ("ii", "oo", "bb")
    }  # no iterations: the pick is the whole training set
    assert r["median_err_pct"]["ala_sa"] == r["median_err_pct"]["ala"]
    assert r["p90_err_pct"]["ala_sa"] == r["p90_err_pct"]["ala"]


def test_table1_first_row_is_a_subset_the_annealing_never_logged(bench_q8: dict) -> None:
    from duetime.predict.ala_select import Subset

    r = bench_q8["configs"]["engine-gemma3-270m-q8-t2"]
    row = bench_q8["table1"][0]
    assert row["dataset"] == "engine-gemma3-270m-q8-t2: unseen subset"
    s = Subset(*(frozenset(row["subset"][k]) for k in ("ii", "oo", "bb")))
    assert s not in {st.subset for st in r["_log"]}
    assert 0.5 <= row["confidence"] < 1.0  # not in-sample: a distance above 0
    assert np.isfinite(row["actual_err_pct"])
