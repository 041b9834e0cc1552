"""plot_sweep writes a real PNG."""

from __future__ import annotations

from math import inf
from pathlib import Path

import pytest

from duetime.metrics import plot_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for policy, slope in (("fcfs", 1.0), ("edf", 0.5)):
        for rate in (1.0, 2.0, 4.0):
            for seed in range(3):
                rows.append(
                    {
                        "policy": policy,
                        "rate_req_s": rate,
                        "seed": seed,
                        "e2e_p90_s": slope * rate + 0.1 * seed,
                        "goodput_req_s": rate / (1 + slope) if seed else None,
                    }
                )
    return rows


def test_plot_sweep_writes_valid_png(tmp_path: Path) -> None:
    path = tmp_path / "plots" / "sweep.png"
    out = plot_sweep(
        sweep_rows(), x="rate_req_s", y=["e2e_p90_s", "goodput_req_s"], hue="policy", path=path
    )
    assert out == path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    assert [p.name for p in path.parent.iterdir()] == ["sweep.png"]  # no temp file left


def test_plot_sweep_draws_one_subplot_per_metric(tmp_path: Path) -> None:
    from matplotlib.image import imread

    one = imread(plot_sweep(sweep_rows(), tmp_path / "one.png", y="e2e_p90_s"))
    two = imread(plot_sweep(sweep_rows(), tmp_path / "two.png", y=["e2e_p90_s", "goodput_req_s"]))
    assert one.shape[0] == two.shape[0]
    assert two.shape[1] > 1.5 * one.shape[1]


def test_plot_sweep_handles_categorical_x(tmp_path: Path) -> None:
    rows = [
        {"policy": p, "model": m, "tel_s": i} for i, (p, m) in enumerate([("a", "s"), ("a", "l")])
    ]
    path = plot_sweep(rows, tmp_path / "cat.png", x="model", y=["tel_s"])
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plot_sweep_needs_a_metric(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="metric"):
        plot_sweep(sweep_rows(), tmp_path / "x.png", y=[])


def test_save_titled_png_titles_lays_out_and_writes(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    f = Figure(figsize=(4, 3))
    f.add_subplot(1, 1, 1).plot([0, 1], [0, 1])
    path = tmp_path / "titled.png"
    assert save_titled_png(f, path, "a title") == path
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert f.get_suptitle() == "a title"


def test_an_infinite_rate_is_drawn_last_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a scaled axis drops x = inf (`sweep --rates 2,4,inf`): the rates become labels
    import duetime.metrics.plot as plot

    drawn = []
    monkeypatch.setattr(plot, "save_png", lambda fig, path, dpi: drawn.append(fig) or path)
    rows = [{"policy": "fcfs", "rate_req_s": r, "e2e_p90_s": i} for i, r in enumerate((4, inf, 2))]
    plot_sweep(rows, tmp_path / "inf.png", y="e2e_p90_s")
    ax = drawn[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "inf"]
    assert list(ax.lines[0].get_xdata()) == [0, 1, 2]
    assert list(ax.lines[0].get_ydata()) == [2, 0, 1]
