"""The fleet half of `duetime sim` / `sweep`: options and what a fleet run prints.

A run is a fleet when it names a router, more than one replica, replica
profiles, a fleet JSON or a failure (``sim/fleet_run.py``); otherwise `sim` runs
today's single-engine simulator, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.common import _progress, err, out
from duetime.cli.paths import input_path

ReplicasOpt = Annotated[int, typer.Option(min=1, help="Replicas behind the router (a fleet).")]
RouterOpt = Annotated[
    str | None,
    typer.Option(help="Router of a fleet (see `duetime routers`); default round-robin."),
]
ReplicaProfileOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--replica-profile",
        help="A replica's profile; repeat once per replica (replicas may differ).",
        callback=input_path,
    ),
]
FleetOpt = Annotated[
    str | None,
    typer.Option(
        "--fleet",
        help='Fleet JSON: {"replicas": [{"profile", "count", "slowdown", "kv_capacity", '
        '"max_num_seqs", "name"}]} (docs/fleet.md).',
        callback=input_path,
    ),
]
FailOpt = Annotated[
    list[str] | None,
    typer.Option("--fail", help="REPLICA@SECONDS: that replica fails then; repeatable."),
]


def profile_unused(
    ctx: typer.Context, replica_profile: list[str] | None, fleet: str | None
) -> None:
    """Refuse ``--profile`` beside a fleet whose replicas name their own profiles: it was
    checked, then priced nothing."""
    from duetime.cli.common import given_options

    if (replica_profile or fleet) and given_options(ctx, "profile"):
        which = "--fleet" if fleet else "--replica-profile"
        raise ValueError(f"--profile: each replica names its own profile in {which}")


def fleet_fields(
    replicas: int,
    router: str | None,
    replica_profile: list[str] | None,
    fleet: str | None,
    fail: list[str] | None,
) -> dict[str, Any]:
    """The SimSpec fields of the fleet options, checked."""
    from duetime.sim.fleet_build import parse_failure

    if router is not None:
        from duetime.routers import make_router

        make_router(router)  # an unknown name fails before anything runs
    return {
        "replicas": replicas,
        "router": router,
        "replica_profiles": tuple(replica_profile or ()),
        "fleet": fleet,
        "failures": tuple(parse_failure(f) for f in fail or ()),
    }


def run_and_report(
    spec: Any,
    plan: Any,
    json_path: Path | None,
    plot: Path | None,
    save: Callable[[], None] | None = None,
) -> None:
    """Run a fleet spec; write JSON / PNG (and what ``save`` writes, once the run
    succeeded), then print the fleet's and each replica's table: the files first, so
    a closed stdout (`| head -1`) fails the table, not them."""
    from duetime.metrics import render_table, write_json
    from duetime.sim.fleet_run import run_fleet

    prog, cb = _progress(len(plan.jobs), f"simulating {spec.router or 'round-robin'} fleet")
    with prog:
        result, row, per = run_fleet(spec, progress=cb, plan=plan)
    label = "fleet"
    if save is not None:
        save()
    if json_path is not None:
        write_json(json_path, {"spec": spec.recorded(), "summary": row, "replicas": per})
    if plot is not None:
        from duetime.metrics.run_plot import plot_latency_cdf

        runs = {label: result.records}
        runs.update(
            {
                f"{r['replica']}: {r['name']}": rep.records
                for r, rep in zip(per, result.replicas, strict=True)
            }
        )
        plot_latency_cdf(runs, plot)
    out.print(render_table([(label, row), *((_short(r), r) for r in per)]))
    out.print(
        f"{row['replicas']} replicas, router {row['router']}: routed {row['routed']:,}, "
        f"refused {row['refused']:,}, re-routed {row['rerouted']:,}, failed {row['failed']:,}; "
        f"simulated {result.sim_time:,.1f} s in {result.wall_s:.2f} s wall "
        f"({result.engine_steps:,} steps)"
    )
    if spec.router == "forecast" and plan.predictor_name in (None, "none") and row["refused"]:
        err.print(
            "note: without a length predictor the forecast router takes each request to "
            "need its max_tokens, so it refuses what a length would admit "
            "(--predictor noisy:0.3, or learned)"
        )


def _short(r: dict[str, Any]) -> str:
    """A replica's column label: ``r2``, or ``r2 down`` once it failed."""
    return f"r{r['replica']}" + ("" if r["up"] else " down")
