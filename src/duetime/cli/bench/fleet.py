"""`duetime bench fleet`: routers compared at 50-95 % of fleet capacity."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import SeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, comma_list, out


@bench_app.command("fleet")
def bench_fleet(
    replicas: Annotated[int, typer.Option(min=1, help="Replicas in each fleet.")] = 4,
    requests: Annotated[int, typer.Option(min=1, help="Requests per run.")] = 1500,
    routers: Annotated[str, typer.Option(help="Comma-separated routers (default: all).")] = "",
    loads: Annotated[str, typer.Option(help="Comma-separated % of capacity.")] = "50,70,85,95",
    predictor: Annotated[str, typer.Option(help="Length predictor the routers see.")] = (
        "noisy:0.3"
    ),
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Every router on a homogeneous and a mixed fleet: deadline hit rate, goodput,
    p50/p99 e2e and refusals (ShareGPT, per-class deadlines, FCFS replicas)."""
    from duetime.bench import fleet
    from duetime.metrics import render_table

    with _user_errors():
        try:
            load_list = [float(x) / 100 for x in loads.split(",")]
        except ValueError:
            raise ValueError(
                f"--loads must be comma-separated percentages, got {loads!r}"
            ) from None
        names = comma_list(routers) or None
        fig = fleet.run(
            replicas=replicas,
            requests=requests,
            seed=seed,
            routers=names,
            loads=load_list,
            predictor=predictor,
        )
    for fleet_name, cap in fig["capacity_req_s"].items():
        for pct in sorted({r["load_pct"] for r in fig["rows"]}):
            rows = [r for r in fig["rows"] if r["fleet"] == fleet_name and r["load_pct"] == pct]
            out.print(f"[bold]{fleet_name}[/] fleet, {pct} % of {cap:.2f} req/s")
            out.print(render_table([(r["router"], r) for r in rows], keys=list(fleet.FIGURES)))
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=fleet.plot)
