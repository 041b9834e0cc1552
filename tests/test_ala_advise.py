"""`duetime advise batch`: the largest batch whose predicted wall time meets a deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.predict.ala_advise import advise_batch
from duetime.predict.ala_model import ThroughputPrediction


class LinearUpTo8:
    """10 tok/s per request up to bb = 8, flat after; interval ±20 %."""

    def predict_throughput(self, ii: int, oo: int, bb: int) -> ThroughputPrediction:
        point = 10.0 * min(bb, 8)
        return ThroughputPrediction(point, 0.8 * point, 1.2 * point, confidence=1.0)


def test_advice_hand_case() -> None:
    # wall(bb) = bb·oo / thpt: 10 s for bb <= 8 (oo = 100), then 100·bb/80 s.
    adv = advise_batch(LinearUpTo8(), ii=64, oo=100, deadline_s=15.0, max_batch=32)
    assert adv["bb_expected"] == 12  # 12·100/80 = 15 s
    # pessimistic wall = bb·100 / (0.8·thpt): 12.5 s up to bb = 8, then 1.5625·bb
    assert adv["bb_safe"] == 9  # 9 · 1.5625 = 14.06 s; 10 → 15.6 s
    tight = advise_batch(LinearUpTo8(), ii=64, oo=100, deadline_s=5.0, max_batch=32)
    assert tight["bb_expected"] is None
    assert tight["bb_safe"] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deadline_s": 0.0}, "deadline"),
        ({"max_batch": 0}, "max_batch"),
        # refused up front (it looped a million predictions first)
        ({"max_batch": 1_000_001}, r"max_batch \(--max-batch\) must be in \[1, 1,000,000\]"),
        ({"ii": 10**20}, r"ii \(--input-len\)"),
    ],
)
def test_advice_rejects_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    args = {"ii": 1, "oo": 1, "deadline_s": 1.0, "max_batch": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        advise_batch(LinearUpTo8(), **args)  # type: ignore[arg-type]


def test_cli_advise_batch_json(tmp_path: Path) -> None:
    out = tmp_path / "adv.json"
    args = ["advise", "batch", "--input-len", "512", "--output-len", "128", "--deadline", "10"]
    result = CliRunner().invoke(app, [*args, "--max-batch", "128", "--json", str(out)])
    assert result.exit_code == 0, result.output
    fig = json.loads(out.read_text())
    assert 1 <= fig["bb_safe"] <= fig["bb_expected"] <= 128
    chosen = fig["options"][fig["bb_expected"] - 1]
    assert chosen["wall_s"] <= 10.0 < fig["options"][fig["bb_expected"]]["wall_s"]
    bad = CliRunner().invoke(app, [*args[:-1], "-1"])
    assert bad.exit_code == 2
    unknown = CliRunner().invoke(app, [*args, "--config", "no-such-config"])
    assert unknown.exit_code == 2
    assert "no-such-config" in unknown.output


def test_cli_advise_batch_says_what_bounds_its_answer(tmp_path: Path) -> None:
    """A lower bound of 0 tok/s printed every pessimistic wall time as 'inf' (the JSON's
    null), and an answer set by --max-batch read as the model's."""
    out = tmp_path / "adv.json"
    args = ["advise", "batch", "--input-len", "1000", "--output-len", "300", "--deadline", "600",
            "--config", "engine-gemma3-270m-fp32-t1", "--max-batch", "8",
            "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "inf" not in text
    assert "unbounded" in text
    assert "every batch up to --max-batch 8 meets it" in text
    fig = json.loads(out.read_text())
    assert fig["coverage"] == 0.9
    assert fig["bb_expected"] == 8
    assert {o["wall_hi_s"] for o in fig["options"]} == {None}
