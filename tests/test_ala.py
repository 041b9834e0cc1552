"""ALA throughput model: curve fit, confidence, annealing, data files, CLI, accuracy."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.predict import ala_data
from duetime.predict.ala_collect import EngineSpec, Grid, SimSpec, collect
from duetime.predict.ala_curve import curve, fit_curve, initial_guess
from duetime.predict.ala_data import AlaDataError, Measurement, append_rows, read_csv
from duetime.predict.ala_model import AlaModel, PointConfidence, ThroughputPrediction
from duetime.predict.ala_select import ErrorPredictor, Subset, anneal, encode

BB = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256], dtype=float)


def test_fit_recovers_known_curve() -> None:
    rng = np.random.default_rng(0)
    y = curve(BB, 900.0, 0.03, 1000.0) * np.exp(rng.normal(0, 0.005, BB.size))
    p = fit_curve(BB, y)
    assert p is not None
    assert p.a == pytest.approx(900.0, rel=0.03)
    assert p.b == pytest.approx(0.03, rel=0.05)
    assert p.c == pytest.approx(1000.0, rel=0.02)


def test_initial_guess_follows_the_paper() -> None:
    g = initial_guess(np.array([4.0, 4.0]), np.array([10.0, 11.0]))
    assert (g.a, g.b, g.c) == (1.0, 0.001, 0.0)  # single batch size: the paper's defaults
    g = initial_guess(BB, curve(BB, 900.0, 0.03, 1000.0))
    assert g.c == pytest.approx(np.percentile(curve(BB, 900.0, 0.03, 1000.0), 90))
    assert g.b == pytest.approx(1 / (np.percentile(BB, 90) - np.percentile(BB, 10)))
    assert fit_curve(np.array([1.0, 2.0]), np.array([5.0, 9.0])) is None  # 3 params, 2 points


def test_confidence_is_one_on_data_and_falls_with_distance() -> None:
    ii, oo, bb = np.meshgrid([64, 128, 256, 512], [32, 64, 128], [1, 4, 16])
    conf = PointConfidence(ii.ravel(), oo.ravel(), bb.ravel())
    assert conf(256, 64, 4) == pytest.approx(1.0)
    far = [conf(512 * 2**k, 64, 4) for k in range(5)]
    assert far[0] == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(far))
    assert 0.5 <= far[-1] < 0.9


def test_annealing_improves_a_toy_objective_and_is_seeded() -> None:
    target = np.array([1, 0, 1, 1, 0, 0, 1, 0], dtype=bool)

    def err(s: tuple[bool, ...]) -> float:
        return float(np.sum(np.array(s) != target))

    def flip(s: tuple[bool, ...], rng: np.random.Generator) -> tuple[bool, ...]:
        k = int(rng.integers(len(s)))
        return tuple(not v if j == k else v for j, v in enumerate(s))

    s0: tuple[bool, ...] = (False,) * 8
    best, best_e, log = anneal(err, s0, flip, n_iter=60, tau0=0.5, seed=3)
    assert best_e == err(best)
    assert best_e < err(s0)
    assert len(log) == 61
    assert log[0].err_pct == err(s0)
    assert [st.best_err_pct for st in log] == sorted((st.best_err_pct for st in log), reverse=True)
    again = anneal(err, s0, flip, n_iter=60, tau0=0.5, seed=3)[2]
    assert [st.err_pct for st in again] == [st.err_pct for st in log]


def _toy_universe() -> tuple[ala_data.ConfigData, Subset, Subset]:
    """Six runs over ii in {64, 128}, bb in {1, 2, 4}; the universe; the ii = 64 half."""
    data = ala_data.ConfigData(
        "toy",
        np.array([64, 64, 64, 128, 128, 128]),
        np.array([32] * 6),
        np.array([1, 2, 4, 1, 2, 4]),
        np.array([10.0, 18, 30, 9, 17, 28]),
    )
    u = Subset.of(data)
    return data, u, Subset(frozenset({64}), u.oo, u.bb)


def test_error_predictor_encodes_subsets_and_gives_confidence() -> None:
    data, u, small = _toy_universe()
    assert encode(small, u).tolist() == [1, 0, 1, 1, 1, 1]  # ii, then bb, then oo bits
    log = anneal(lambda s: 5.0 + len(s.ii), u, lambda s, r: small, n_iter=3)[2]
    ep = ErrorPredictor(log, u, data)
    # distance 0 to a logged loop subset; the starting subset (all of data) is not one
    assert ep.confidence(data.select(small.mask(data))) == pytest.approx(1.0)
    assert 0.5 <= ep.confidence(data) < 1.0
    far = ala_data.ConfigData("far", data.ii * 50, data.oo * 50, data.bb * 50, data.thpt)
    assert ep.confidence(far) < 0.8
    assert np.isfinite(ep.predict(small))


def test_error_predictor_learns_the_loop_entries_not_the_starting_subset() -> None:
    # Alg. 6 appends (S', E') only inside its loop: S0 (iteration 0 of our log) is
    # not training data for the error predictor (Alg. 7) nor a neighbour (Alg. 8).
    data, u, small = _toy_universe()
    log = anneal(lambda s: 100.0 if s == u else 5.0, u, lambda s, r: small, n_iter=3)[2]
    assert [st.iteration for st in log] == [0, 1, 2, 3]
    assert log[0].subset == u
    ep = ErrorPredictor(log, u, data)
    assert [st.iteration for st in ep.steps] == [1, 2, 3]
    # trained on S0 too, XGBoost would predict far above 5 % for S0's own encoding
    assert ep.predict(u) == pytest.approx(5.0, abs=0.05)
    assert ep.confidence(data) < 1.0
    # with no loop iteration the starting subset is all there is, and it is used
    only_s0 = anneal(lambda s: 100.0 if s == u else 5.0, u, lambda s, r: small, n_iter=0)[2]
    ep0 = ErrorPredictor(only_s0, u, data)
    assert [st.iteration for st in ep0.steps] == [0]
    assert ep0.predict(u) == pytest.approx(100.0, abs=1.0)
    assert ep0.confidence(data) == pytest.approx(1.0)


def _write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "t.csv"
    p.write_text(",".join(ala_data.COLUMNS) + "\n" + body)
    return p


@pytest.mark.parametrize(
    ("body", "where", "what"),
    [
        ("c,sim,64,32,1,0,100,1\nc,sim,64,x,2,0,100,1\n", ":3:4:", "oo must be an integer"),
        ("c,sim,64,32,1,0,-5,1\n", ":2:7:", "thpt_tok_s must be finite"),
        ("c,gpu,64,32,1,0,5,1\n", ":2:2:", "source must be one of"),
        ("c,sim,64,32,1\n", ":2:6:", "expected 8 fields, got 5"),
        ("c,sim,64,32,0,0,5,1\n", ":2:5:", "bb must be >= 1"),
        ("c,sim," + "9" * 30 + ",32,1,0,5,1\n", ":2:3:", "ii must be <= 10,000,000"),
        ("c,sim,64,32,2000000,0,5,1\n", ":2:5:", "bb must be <= 1,000,000"),
    ],
)
def test_csv_errors_name_file_line_column(tmp_path: Path, body: str, where: str, what: str) -> None:
    p = _write(tmp_path, body)
    with pytest.raises(AlaDataError) as e:
        read_csv(p)
    assert str(e.value).startswith(f"{p}{where}")
    assert what in str(e.value)


def test_csv_bad_header(tmp_path: Path) -> None:
    p = tmp_path / "h.csv"
    p.write_text("config,ii\nx,1\n")
    with pytest.raises(AlaDataError, match=r"h\.csv:1:1: header must be"):
        read_csv(p)


def recording_runner(calls: list[tuple[int, int, int, int]]) -> type:
    """A runner factory for ``collect`` that records each (ii, oo, bb, rep) it is asked
    for and reports ``bb * oo`` tokens in 1 s."""

    class Stub:
        def __init__(self, s: SimSpec | EngineSpec) -> None:
            pass

        def run(self, ii: int, oo: int, bb: int, rep: int) -> tuple[float, float]:
            calls.append((ii, oo, bb, rep))
            return float(bb * oo), 1.0

    return Stub


def test_collection_appends_and_resumes(tmp_path: Path) -> None:
    calls: list[tuple[int, int, int, int]] = []
    stub = recording_runner(calls)
    path = tmp_path / "c.csv"
    grid = Grid(ii=(16,), oo=(4, 8), bb=(1, 2))
    append_rows(path, [Measurement("sim-a100-llama2-7b", "sim", 16, 4, 1, 0, 4.0, 1.0)])
    counts = collect(["sim-a100-llama2-7b"], path, grid=grid, runner_factory=stub)
    assert counts == {"run": 3, "skipped": 1, "torn": 0}
    assert len(calls) == 3
    assert collect(["sim-a100-llama2-7b"], path, grid=grid, runner_factory=stub)["run"] == 0
    assert len(read_csv(path)) == 4


def test_a_collection_killed_mid_row_resumes(tmp_path: Path) -> None:
    """A row cut by an interrupted append made the file unreadable: the resumable
    collection stopped on 'expected 8 fields, got 5' until the row was cut by hand."""
    calls: list[tuple[int, int, int, int]] = []
    path = tmp_path / "c.csv"
    grid = Grid(ii=(16,), oo=(4, 8), bb=(1,))
    collect(["sim-a100-llama2-7b"], path, grid=grid, runner_factory=recording_runner(calls))
    whole = path.read_text()
    path.write_text(whole[: whole.rindex(",1,0,") + 3])  # the last row, cut after its bb
    counts = collect(["sim-a100-llama2-7b"], path, grid=grid, runner_factory=recording_runner([]))
    assert counts == {"run": 1, "skipped": 1, "torn": 1}
    assert path.read_text() == whole


def test_a_last_row_without_its_newline_is_kept(tmp_path: Path) -> None:
    """A hand-edited file whose whole last row lacks a newline is not cut."""
    path = tmp_path / "c.csv"
    append_rows(path, [Measurement("sim-a100-llama2-7b", "sim", 16, 4, 1, 0, 4.0, 1.0)])
    path.write_text(path.read_text().rstrip("\n"))
    assert ala_data.drop_torn_row(path) is None
    assert len(read_csv(path)) == 1


def test_collection_simulates_a_real_shape(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    collect(["sim-a100-llama2-7b"], path, grid=Grid(ii=(64,), oo=(32,), bb=(1, 8)))
    rows = read_csv(path)
    assert [r.bb for r in rows] == [1, 8]
    assert rows[1].thpt_tok_s > 4 * rows[0].thpt_tok_s  # batching pays on a GPU profile


def test_ala_beats_linear_baseline_on_shipped_data() -> None:
    from duetime.bench.ala import _concat, _x, baseline, err_pct, split_pairs

    data = ala_data.config_data("sim-a100-llama2-7b")
    train, val, test = split_pairs(data, seed=0)
    fit = _concat(train, val)
    ala = np.median(err_pct(AlaModel.fit(fit).predict(test.ii, test.oo, test.bb), test.thpt))
    lin = baseline("linear", 0).fit(_x(fit), fit.thpt)
    assert ala < 0.5 * np.median(err_pct(lin.predict(_x(test)), test.thpt))
    assert ala < 15.0


def test_extrapolation_splits_train_low_and_test_beyond() -> None:
    from duetime.bench.ala import extrapolation, extrapolation_splits

    data = ala_data.config_data("sim-a100-llama2-7b")
    splits = extrapolation_splits(data)
    train, test = splits["batch"]
    assert train.bb.max() == 32 < test.bb.min()  # 6 of the grid's 9 batch sizes train
    assert set(train.pairs()) == set(test.pairs()) == set(data.pairs())
    train, test = splits["shape"]
    assert not set(train.pairs()) & set(test.pairs())
    assert len(train) + len(test) == len(data)
    # The saturating curve extrapolates in bb where trees plateau at the last value seen.
    med = extrapolation(data, seed=0)["batch"]["median_err_pct"]
    assert med["ala"] < med["random_forest"]
    # The 2-thread engine grid (bb 1..32): bb <= 8 train, 16 and 32 test.
    train, test = extrapolation_splits(ala_data.config_data("engine-gemma3-270m-q8-t2"))["batch"]
    assert (train.bb.max(), sorted(set(test.bb.tolist()))) == (8, [16, 32])
    # too few batch sizes to leave three for the curve and some to test: no split
    small = ala_data.config_data("engine-gemma3-270m-q8-t2")
    three = small.select(small.bb <= 4)
    assert "batch" not in extrapolation_splits(three)


def test_prediction_interval_is_ordered() -> None:
    with pytest.raises(ValueError, match="lo <= point"):
        ThroughputPrediction(point=5.0, lo=6.0, hi=7.0, confidence=1.0)


runner = CliRunner()


def test_cli_predict_throughput_json(tmp_path: Path) -> None:
    """``--json PATH`` as every other command takes it; the line is printed as well."""
    path = tmp_path / "point.json"
    res = runner.invoke(
        app,
        ["predict", "throughput", "--input-len", "500", "--output-len", "100",
         "--batch", "16", "--json", str(path)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "tok/s" in res.output
    p = json.loads(path.read_text())
    assert (p["ii"], p["bb"]) == (500, 16)
    assert p["lo_tok_s"] <= p["point_tok_s"] <= p["hi_tok_s"]
    assert 0.5 <= p["confidence"] <= 1


@pytest.mark.parametrize(
    "args",
    [
        ["--input-len", "0", "--output-len", "8", "--batch", "1"],
        ["--input-len", "8", "--output-len", "8", "--batch", "1", "--config", "nope"],
    ],
)
def test_cli_bad_input_exits_2(args: list[str]) -> None:
    res = runner.invoke(app, ["predict", "throughput", *args])
    assert res.exit_code == 2


def test_cli_bad_csv_exits_2(tmp_path: Path) -> None:
    p = _write(tmp_path, "c,sim,64,32,1,0,oops,1\n")
    res = runner.invoke(
        app,
        ["predict", "throughput", "--input-len", "8", "--output-len", "8", "--batch", "1",
         "--config", "c", "--data", str(p)],
    )  # fmt: skip
    assert res.exit_code == 2
    assert ":2:7:" in res.output
