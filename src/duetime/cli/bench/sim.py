"""`duetime bench sim`: how fast the simulator runs a large ShareGPT workload."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import SeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, _user_errors, bench_app, out


@bench_app.command("sim")
def bench_sim(
    requests: Annotated[int, typer.Option(min=1)] = 100_000,
    seed: SeedOpt = 0,
    target_running: Annotated[
        float, typer.Option(help="Sequences to keep running (on each replica).")
    ] = 128.0,
    replicas: Annotated[int, typer.Option(min=1, help="A fleet of this many replicas.")] = 1,
    router: Annotated[str, typer.Option(help="The fleet's router.")] = "lor",
    json_path: JsonOpt = None,
) -> None:
    """Simulator speed at 100k ShareGPT requests (target: <= 10 s wall); with
    --replicas, a fleet's (target: 1M requests over 64 replicas <= 60 s, <= 4 GiB)."""
    from duetime.bench import sim_speed

    with _user_errors():
        fig = sim_speed.run(requests, seed, target_running, replicas, router)
    if replicas > 1:
        out.print(
            f"{fig['requests']:,} requests over {fig['replicas']} replicas ({fig['router']}), "
            f"rate {fig['rate_req_s']:.1f} req/s, mean running per replica "
            f"{fig['mean_running_per_replica']:.1f}\nwall {fig['wall_s']:.2f} s (target <= "
            f"{fig['target_wall_s']:.0f} s), {fig['us_per_request']:.1f} us/request, peak RSS "
            f"{fig['peak_rss_mib']:,.0f} MiB (target <= {fig['target_peak_rss_mib']:,.0f})"
        )
        save_figures(fig, json_path=json_path)
        return
    out.print(
        f"{fig['requests']:,} requests, {fig['policy']}, profile {fig['profile']}, "
        f"rate {fig['rate_req_s']:.2f} req/s, mean running {fig['mean_running']:.1f}\n"
        f"wall {fig['wall_s']:.2f} s (target <= {fig['target_wall_s']:.0f} s) for "
        f"{fig['sim_span_s']:,.0f} s simulated: "
        f"{fig['sim_speedup_x']:,.0f}x faster than real time\n"
        f"{fig['engine_steps']:,} engine steps = {fig['steps_per_s']:,.0f} steps/s "
        f"({fig['us_per_step']:.1f} us/step), {fig['requests_per_s']:,.0f} requests/s; "
        f"workload build {fig['workload_build_s']:.2f} s, rate calibration "
        f"{fig['rate_calibration_s']:.1f} s (pilot runs, not counted in wall)"
    )
    save_figures(fig, json_path=json_path)
