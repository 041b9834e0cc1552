"""`duetime bench ala`: the ALA throughput model against regression baselines (Table I)."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import SeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import AlaDataOpt, JsonOpt, PlotOpt, _progress, _user_errors, bench_app, out


@bench_app.command("ala")
def bench_ala(
    config: Annotated[list[str] | None, typer.Option(help="Config(s); default: all.")] = None,
    data: AlaDataOpt = None,
    sa_iters: Annotated[int, typer.Option(min=1, help="Simulated-annealing iterations.")] = 25,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """ALA throughput model vs regression baselines on held-out (ii, oo) pairs; Table I."""
    from duetime.bench import ala as bench
    from duetime.bench import ala_report as report

    with _user_errors():
        prog, cb = _progress(1, "configs")
        with prog:
            fig = bench.run(data, config, seed=seed, sa_iters=sa_iters, progress=cb)
    for t in report.tables(fig):
        out.print(t)
    for line in report.sa_lines(fig):
        out.print(line, highlight=False)
    out.print(f"(x: candidate rejected); wall {fig['wall_s']:.1f} s")
    save_figures(
        fig, json_path=json_path, plot=plot, plot_fn=report.plot, json_fig=report.public(fig)
    )
