"""The Amin and deferred-prefill benchmarks at toy scale: they write what they promise."""

from __future__ import annotations

import json
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
    assert len(rows) == 2 + 2 * 2 * 5  # H-SF per setting, Amax/Amin per setting × construction
    assert all(row["completed"] == 40 for row in rows)
    assert {row["tel_ratio_vs_hsf"] for row in rows if row["policy"] == "hsf"} == {1.0}
    assert "overlap-0.99" in r.output
    assert "LMSYS" in r.output


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
