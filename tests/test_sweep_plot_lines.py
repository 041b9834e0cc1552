"""A sweep's plot draws one line per policy × fleet size × router, labelled with what
varies: a line per policy alone averaged a policy's fleets into one point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import duetime.metrics.plot as plot_module
from duetime.cli import app
from duetime.metrics import plot_sweep


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures plot_sweep draws, kept when it saves them."""
    figures: list[Any] = []
    real = plot_module.save_png

    def keep(fig: Any, path: Any, dpi: int = 110) -> Path:
        figures.append(fig)
        return real(fig, path, dpi=dpi)

    monkeypatch.setattr(plot_module, "save_png", keep)
    return figures


def _labels(fig: Any) -> tuple[str, list[str]]:
    legend = fig.axes[0].get_legend()
    return legend.get_title().get_text(), [t.get_text() for t in legend.get_texts()]


def _rows() -> list[dict[str, Any]]:
    return [
        {"policy": p, "replicas": n, "router": r, "rate_req_s": 4.0, "seed": 0, "e2e": float(n)}
        for p in ("fcfs", "edf")
        for n in (2, 4)
        for r in ("lor", "forecast")
    ]


def test_one_line_per_combination_that_varies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _capture(monkeypatch)
    plot_sweep(_rows(), tmp_path / "a.png", y="e2e", hue=("policy", "replicas", "router"))
    title, labels = _labels(figures[-1])
    assert title == "policy, replicas, router"
    assert len(labels) == 8
    assert "edf, 4, forecast" in labels
    same_router = [r for r in _rows() if r["router"] == "lor"]
    plot_sweep(same_router, tmp_path / "b.png", y="e2e", hue=("policy", "replicas", "router"))
    assert _labels(figures[-1]) == ("policy, replicas", ["fcfs, 2", "fcfs, 4", "edf, 2", "edf, 4"])
    one = [r for r in same_router if r["replicas"] == 2]
    plot_sweep(one, tmp_path / "c.png", y="e2e", hue=("policy", "replicas", "router"))
    assert _labels(figures[-1]) == ("policy", ["fcfs", "edf"])  # as a plot by policy alone


def test_sweep_plots_a_line_per_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _capture(monkeypatch)
    res = CliRunner().invoke(
        app,
        [
            "sweep", "--policies", "fcfs", "--rates", "4", "--replicas", "1,2",
            "--routers", "lor", "--workload", "synthetic", "--requests", "20",
            "--workers", "1", "--metrics", "e2e_p90_s", "--plot", str(tmp_path / "s.png"),
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert _labels(figures[-1]) == ("replicas", ["1", "2"])
