"""`duetime bench fleet`: routers compared at 50-95 % of fleet capacity."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import SeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, out
from duetime.comma_lists import comma_list, comma_numbers


@bench_app.command("fleet")
def bench_fleet(
    replicas: Annotated[int, typer.Option(min=1, help="Replicas in each fleet.")] = 4,
    requests: Annotated[int, typer.Option(min=1, help="Requests per run.")] = 1500,
    routers: Annotated[str, typer.Option(help="Comma-separated routers (default: all).")] = "",
    loads: Annotated[
        str, typer.Option(help="Comma-separated % of the fleet's capacity (85: 85 %), in [1, 200).")
    ] = "50,70,85,95",
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
        load_list = [pct / 100 for pct in _percentages(loads)]
        fig = fleet.run(
            replicas=replicas,
            requests=requests,
            seed=seed,
            routers=list(dict.fromkeys(comma_list(routers))) or None,  # lor,lor: one column
            loads=load_list,
            predictor=predictor,
        )
        # The files first: a closed stdout (`| head -1`) fails the tables, not them.
        save_figures(fig, json_path=json_path, plot=plot, plot_fn=fleet.plot)
    for fleet_name, cap in fig["capacity_req_s"].items():
        for pct in sorted({r["load_pct"] for r in fig["rows"]}):
            rows = [r for r in fig["rows"] if r["fleet"] == fleet_name and r["load_pct"] == pct]
            out.print(f"[bold]{fleet_name}[/] fleet, {pct} % of {cap:.2f} req/s")
            out.print(render_table([(r["router"], r) for r in rows], keys=list(fleet.FIGURES)))


def _percentages(text: str) -> list[float]:
    """``--loads``: percentages of capacity, each in [1, 200) (a share such as 0.85
    is refused, not run at 0.85 %)."""
    values = comma_numbers("--loads", text, float, "percentages of capacity")
    for pct in values:
        if not 1 <= pct < 200:  # NaN too
            raise ValueError(
                f"--loads are percentages of capacity, each in [1, 200) (85 for 85 %), got {pct:g}"
            )
    return values
