"""Simulation commands: `duetime sim`, `sweep`, `demo`, `policies`, `profiles`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.common import (
    ArrivalOpt,
    BurstSizeOpt,
    CvOpt,
    JsonOpt,
    PlotOpt,
    ProfileOpt,
    RateOpt,
    _fail,
    _progress,
    _user_errors,
    app,
    out,
    rate_text,
    refuse_drawing_options,
)
from duetime.cli.paths import input_path, output_path, writable
from duetime.cli.sim_fleet import FailOpt, FleetOpt, ReplicaProfileOpt, ReplicasOpt, RouterOpt
from duetime.comma_lists import comma_list, comma_numbers

# Options `sim` and `sweep` share (a sweep runs `sim` for every policy × rate × seed).
WorkloadOpt = Annotated[
    str,
    typer.Option(
        help="sharegpt, sharegpt-heldout, synthetic, or a JSONL trace path.", callback=input_path
    ),
]
PredictorOpt = Annotated[
    str,
    typer.Option(
        help="policy (the policy's own default), none, oracle, noisy[:<err>], interval:<spec> "
        "or learned[:path] (the trained length model, from the prompt text)."
    ),
]
DeadlineScaleOpt = Annotated[
    float | None,
    typer.Option(
        help="Deadline = arrival + scale × time alone, for each request without one "
        "(default: none; a trace's own deadlines stay)."
    ),
]
PrefixCacheOpt = Annotated[
    int,
    typer.Option(min=0, help="Automatic prefix caching: the cache's budget in tokens (0: none)."),
]
SharedPrefixOpt = Annotated[
    int,
    typer.Option(
        min=0,
        help="Put a system prompt of this many tokens in front of every prompt (0: none; "
        "generated workloads only).",
    ),
]
PrefixGroupsOpt = Annotated[
    int, typer.Option(min=1, help="How many different system prompts --shared-prefix draws from.")
]


@app.command()
def sim(
    ctx: typer.Context,
    policy: Annotated[str, typer.Option(help="Policy name (see `duetime policies`).")] = "fcfs",
    workload: WorkloadOpt = "sharegpt",
    requests: Annotated[int, typer.Option(min=1, help="Number of requests.")] = 2000,
    rate: RateOpt = 4.0,
    arrival: ArrivalOpt = "poisson",
    cv: CvOpt = 1.0,
    burst_size: BurstSizeOpt = 1,
    seed: Annotated[int, typer.Option(min=0, help="Random seed.")] = 0,
    profile: ProfileOpt = "a100-llama2-7b",
    predictor: PredictorOpt = "policy",
    deadline_scale: DeadlineScaleOpt = None,
    kv_capacity: Annotated[
        int | None, typer.Option(min=1, help="KV budget, tokens (default: the profile's).")
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(min=1, help="Batch cap (default: the profile's).")
    ] = None,
    prefix_cache: PrefixCacheOpt = 0,
    shared_prefix: SharedPrefixOpt = 0,
    prefix_groups: PrefixGroupsOpt = 1,
    replicas: ReplicasOpt = 1,
    router: RouterOpt = None,
    replica_profile: ReplicaProfileOpt = None,
    fleet: FleetOpt = None,
    fail: FailOpt = None,
    save_trace: Annotated[
        Path | None, typer.Option(help="Save the workload as JSONL.", callback=output_path)
    ] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Simulate one workload through one policy, on one engine or on a fleet of replicas."""
    from duetime.cli.sim_fleet import fleet_fields, profile_unused, run_and_report
    from duetime.experiment import GENERATED_ONLY, SimSpec, plan_spec, run_planned
    from duetime.metrics import render_table, write_json
    from duetime.sim.fleet_run import is_fleet
    from duetime.workloads import trace_lines

    with _user_errors():
        _trace_draws_nothing(ctx, workload, GENERATED_ONLY)
        profile_unused(ctx, replica_profile, fleet)
        spec = SimSpec(
            policy=policy,
            workload=workload,
            requests=requests,
            rate=rate,
            arrival=arrival,
            cv=cv,
            burst_size=burst_size,
            seed=seed,
            profile=profile,
            predictor=predictor,
            deadline_scale=deadline_scale,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            prefix_cache=prefix_cache,
            shared_prefix=shared_prefix,
            prefix_groups=prefix_groups,
            **fleet_fields(replicas, router, replica_profile, fleet, fail),
        )
        plan = plan_spec(spec)  # every name checked before the trace is taken
        # The jobs as planned, with the deadlines the run uses; written only once the run
        # succeeded, so a failed run leaves no trace file.
        trace = None if save_trace is None else trace_lines(plan.jobs, save_trace)
        if is_fleet(spec):
            run_and_report(spec, plan, json_path, plot, save=lambda: _save_trace(save_trace, trace))
            return
        prog, cb = _progress(len(plan.jobs), f"simulating {policy}")
        with prog:
            result, row = run_planned(plan, progress=cb)
        # The files first: a closed stdout (`| head -1`) fails the table, not them.
        _save_trace(save_trace, trace)
        if json_path is not None:
            write_json(json_path, {"spec": spec.recorded(), "summary": row})
        if plot is not None:
            from duetime.metrics.run_plot import plot_latency_cdf

            plot_latency_cdf({policy: result.records}, plot)
    out.print(render_table([(policy, row)]))
    out.print(
        f"simulated {result.sim_time:,.1f} s in {result.wall_s:.2f} s wall "
        f"({result.engine_steps:,} steps, {result.preemptions:,} preemptions)"
    )
    if row["prompt_cached_pct"] is not None and prefix_cache:
        out.print(f"prefix cache: {row['prompt_cached_pct']:.1f} % of prompt tokens were cached")


def _trace_draws_nothing(ctx: typer.Context, workload: str, names: tuple[str, ...]) -> None:
    """`sim` and `sweep` on a trace file refuse the options that draw a workload; a path
    that does not exist is left to ``build_jobs``, which names it as missing."""
    from duetime.experiment import SimSpec, is_trace

    if is_trace(SimSpec(workload=workload)) and Path(workload).exists():
        refuse_drawing_options(ctx, names)


def _save_trace(path: Path | None, lines: list[str] | None) -> None:
    """`sim --save-trace`: the planned jobs' lines, written after a run that succeeded."""
    if path is not None and lines is not None:
        from duetime.workloads import write_trace_lines

        write_trace_lines(path, lines)


@app.command()
def sweep(
    ctx: typer.Context,
    policies: Annotated[str, typer.Option(help="Comma-separated policy names.")] = "fcfs,edf",
    rates: Annotated[
        str,
        typer.Option(
            help="Comma-separated arrival rates, requests/s, each > 0 (none with a trace)."
        ),
    ] = "2,4,8",
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0",
    workload: WorkloadOpt = "sharegpt",
    requests: Annotated[int, typer.Option(min=1, help="Requests per run.")] = 2000,
    arrival: ArrivalOpt = "poisson",
    cv: CvOpt = 1.0,
    burst_size: BurstSizeOpt = 1,
    profile: ProfileOpt = "a100-llama2-7b",
    predictor: PredictorOpt = "policy",
    deadline_scale: DeadlineScaleOpt = None,
    prefix_cache: PrefixCacheOpt = 0,
    shared_prefix: SharedPrefixOpt = 0,
    prefix_groups: PrefixGroupsOpt = 1,
    replicas: Annotated[
        str, typer.Option(help="Comma-separated fleet sizes (1: one engine, unless --routers).")
    ] = "1",
    routers: Annotated[
        str | None, typer.Option(help="Comma-separated routers (a fleet run each).")
    ] = None,
    replica_profile: ReplicaProfileOpt = None,
    fleet: FleetOpt = None,
    fail: FailOpt = None,
    workers: Annotated[int, typer.Option(min=1, help="Parallel workers.")] = 2,
    use_ray: Annotated[bool, typer.Option("--ray", help="Run on Ray (a local one).")] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Join this Ray cluster (ray://host:10001 or auto); implies --ray."),
    ] = None,
    metrics: Annotated[str, typer.Option(help="Metrics to plot.")] = (
        "e2e_p90_s,ttft_p90_s,deadline_hit_rate,throughput_tok_s"
    ),
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Policies × rates × seeds (× replicas × routers), in parallel: a process pool, or
    Ray with --ray / --ray-address."""
    from duetime.cli.sim_fleet import fleet_fields, profile_unused
    from duetime.experiment import SimSpec, is_trace, row_figures
    from duetime.metrics import plot_sweep, render_table, write_json
    from duetime.sweep import run_sweep

    with _user_errors():
        _trace_draws_nothing(ctx, workload, ("requests", "rates", "arrival", "cv", "burst_size"))
        profile_unused(ctx, replica_profile, fleet)
        rate_list = comma_numbers("--rates", rates, float, "numbers (requests/s)")
        bad = [why for r in rate_list if (why := rate_text("--rates", r)) is not None]
        if bad:
            _fail(bad[0])
        seed_list = comma_numbers("--seeds", seeds, int, "integers")
        if any(s < 0 for s in seed_list):
            _fail(f"--seeds must be non-negative integers, got {seeds!r}")
        plotted = [m.strip() for m in metrics.split(",")]
        figures = row_figures()
        unknown = [m for m in plotted if m not in figures]
        if unknown:  # found before the sweep runs, not as an empty plot after it
            _fail(f"unknown --metrics {unknown}; a row has {', '.join(figures)}")
        sizes = comma_numbers("--replicas", replicas, int, "integers")
        if any(n < 1 for n in sizes):
            _fail(f"--replicas must be >= 1 each, got {replicas!r}")
        router_list: list[str | None] = (
            [r.strip() for r in routers.split(",")] if routers else [None]
        )
        # a name or number given twice ran twice, under one label
        sizes, router_list = list(dict.fromkeys(sizes)), list(dict.fromkeys(router_list))
        rate_list, seed_list = list(dict.fromkeys(rate_list)), list(dict.fromkeys(seed_list))
        policy_list = list(dict.fromkeys(comma_list(policies)))
        if not policy_list:
            _fail("--policies names no policy: give one or more, comma-separated")
        fleets = [
            fleet_fields(n, r, replica_profile, fleet, fail) for n in sizes for r in router_list
        ]
        trace = is_trace(SimSpec(workload=workload))
        if trace:
            rate_list = rate_list[:1]  # a trace has its own arrival times: one run, not one a rate
        specs = [
            SimSpec(
                policy=p,
                workload=workload,
                requests=requests,
                rate=r,
                arrival=arrival,
                cv=cv,
                burst_size=burst_size,
                seed=s,
                profile=profile,
                predictor=predictor,
                deadline_scale=deadline_scale,
                prefix_cache=prefix_cache,
                shared_prefix=shared_prefix,
                prefix_groups=prefix_groups,
                **f,
            )
            for p in policy_list
            for r in rate_list
            for s in seed_list
            for f in fleets
        ]
        prog, cb = _progress(len(specs), "sweep")
        with prog:
            rows = run_sweep(
                specs,
                workers=workers,
                backend="ray" if use_ray or ray_address else "process",
                progress=cb,
                ray_address=ray_address,
            )
        # The files first: a closed stdout (`| head -1`) fails the tables, not them.
        if json_path is not None:
            write_json(json_path, {"specs": [s.recorded() for s in specs], "rows": rows})
        if plot is not None:
            # One line per policy × fleet size × router, labelled with those that vary:
            # a line per policy alone averaged the fleets of a policy into one point.
            x = "seed" if trace else "rate_req_s"
            plot_sweep(rows, x=x, y=plotted, hue=("policy", "replicas", "router"), path=plot)
    for r in rate_list:
        at = "" if trace else f"@{r:g}/s"
        out.print(
            render_table(
                [
                    (f"{row['policy']}{at} s{row['seed']}{_fleet_label(row)}", row)
                    for spec, row in zip(specs, rows, strict=True)
                    if spec.rate == r
                ]
            )
        )


def _fleet_label(row: dict) -> str:
    """`` ×N router`` for a fleet's row in a sweep's table; nothing for one engine."""
    return f" x{row['replicas']} {row['router']}" if "router" in row else ""


def _demo_outputs(out_dir: Path) -> Path:
    """Check before the runs, not after them, that demo.json and demo.png can be written."""
    for name in ("demo.json", "demo.png"):
        writable(out_dir / name)
    return out_dir


@app.command()
def demo(
    requests: Annotated[int, typer.Option(min=1, help="ShareGPT requests in each run.")] = 2000,
    rate: RateOpt = 16.0,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Where JSON and PNG go.", callback=_demo_outputs)
    ] = Path("out"),
) -> None:
    """ShareGPT through FCFS and EDF on the GPU-like profile, with deadlines: table + plot."""
    from duetime.experiment import SimSpec, build_jobs, run_spec
    from duetime.metrics import render_table, write_json
    from duetime.metrics.run_plot import plot_latency_cdf

    specs = [
        SimSpec(policy=policy, requests=requests, rate=rate, deadline_scale=8.0)
        for policy in ("fcfs", "edf")
    ]
    rows = []
    records = {}
    with _user_errors():
        for spec in specs:
            result, row = run_spec(spec, build_jobs(spec))
            rows.append((spec.policy, row))
            records[spec.policy] = result.records
        # The files first: a closed stdout (`| head -1`) fails the table, not them. As
        # `sweep --json` writes them: each run's spec, then its row.
        demo_json = {"specs": [s.recorded() for s in specs], "rows": [row for _, row in rows]}
        write_json(out_dir / "demo.json", demo_json)
        plot_latency_cdf(records, out_dir / "demo.png")
    out.print(
        f"[bold]duetime demo[/]: {requests} ShareGPT requests at {rate:g} req/s on the "
        "a100-llama2-7b profile; deadline = arrival + 8 × time alone"
    )
    out.print(render_table(rows))
    out.print(f"wrote {out_dir / 'demo.json'} and {out_dir / 'demo.png'}")


@app.command()
def policies() -> None:
    """List the registered policies, each with what it does."""
    from duetime.policies.registry import policy_summaries

    _listing(policy_summaries())


@app.command()
def routers() -> None:
    """List the registered fleet routers, each with what it does."""
    from duetime.routers.registry import router_summaries

    _listing(router_summaries())


@app.command()
def profiles() -> None:
    """List the shipped step-cost profiles, each with the hardware and model it prices."""
    import json

    from duetime.sim.profiles import builtin_profiles, profile_path

    about = {}
    for name in builtin_profiles():
        data = json.loads(profile_path(name).read_text())
        about[name] = ", ".join(str(data[k]) for k in ("hardware", "model") if k in data)
    _listing(about)


def _listing(about: dict[str, str]) -> None:
    """One line a name, its description beside it (the name first, for scripts)."""
    width = max(map(len, about), default=0)
    for name, text in about.items():
        line = f"{name:<{width}}  {text}".rstrip()
        out.print(line, markup=False, highlight=False, soft_wrap=True)
