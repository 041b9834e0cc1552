"""Write a bench's figures where ``--plot`` and ``--json`` ask: the tail of every bench command."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

PlotFn = Callable[[dict[str, Any], Path], object]


def save_figures(
    fig: dict[str, Any],
    *,
    json_path: Path | None,
    plot: Path | None = None,
    plot_fn: PlotFn | None = None,
    json_fig: Mapping[str, Any] | None = None,
) -> None:
    """Plot ``fig`` with ``plot_fn`` if ``--plot`` was given, then write ``--json``, and
    say what was written: several benches plot to ``out/bench-*.png`` by default.

    ``json_fig`` replaces ``fig`` in the JSON where a bench keeps private keys
    (plot data, live objects) out of it. Plot first, JSON second: the order the
    commands have always used, so a failing plot leaves no half-written run.
    """
    from rich.markup import escape

    from duetime.cli.common import _user_errors, out
    from duetime.metrics import write_json
    from duetime.metrics.atomic import is_stream

    written = []
    with _user_errors():  # a full disk or a vanished folder: one line naming the file
        if plot is not None and plot_fn is not None:
            plot_fn(fig, plot)
            written.append(str(plot))
        if json_path is not None:
            write_json(json_path, fig if json_fig is None else json_fig)
            written.append(str(json_path))
    written = [path for path in written if not is_stream(Path(path))]  # /dev/stdout: seen
    if written:
        out.print(f"wrote {escape(', '.join(written))}", highlight=False)
