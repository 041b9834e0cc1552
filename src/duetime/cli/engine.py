"""Real-engine commands: `duetime profile` and `duetime validate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.bench.limits import MAX_ENGINE_REQUESTS
from duetime.cli.common import (
    DtypeOpt,
    EvictionOpt,
    MaxTokensOpt,
    PlotOpt,
    RateOpt,
    ThreadsOpt,
    _fail,
    _user_errors,
    app,
    given_options,
    pct_text,
)
from duetime.cli.common import out as console
from duetime.cli.paths import input_path, output_path
from duetime.cli.profile_engine import EngineLimits, print_misses


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


@app.command()
def profile(
    ctx: typer.Context,
    dtype: DtypeOpt = "q8",  # the engine `duetime serve` runs
    threads: ThreadsOpt = 2,
    quick: Annotated[bool, typer.Option(help="A small grid (smoke test).")] = False,
    out: Annotated[
        Path, typer.Option("--out", help="Profile JSON to write.", callback=output_path)
    ] = Path("out/gemma3-270m-cpu.json"),
    # the engine limits the profile records
    kv_capacity: Annotated[int, typer.Option(min=1, help="KV budget, tokens.")] = 32_768,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Most requests in one batch.")] = 64,
    max_batch_tokens: Annotated[int, typer.Option(min=1, help="Most tokens in one step.")] = 2048,
    serve_requests: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also fit to the steps of a short serving run of this many ShareGPT "
            "requests (seed 1; 0: the grid only; --quick: at most 4).",
        ),
    ] = 40,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report here.", callback=output_path)
    ] = None,
    samples_path: Annotated[
        Path | None,
        typer.Option(
            "--samples",
            help="Write every timed step here as JSON lines (the executor's telemetry "
            "fields, and source: grid or serving), to refit or compare offline.",
            callback=output_path,
        ),
    ] = None,
    plot: PlotOpt = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Profile this OpenAI-compatible server black-box (timed streamed "
            "requests) instead of the embedded engine.",
        ),
    ] = None,
    served_model: Annotated[
        str | None,
        typer.Option(help="With --url: the model to probe (default: the first listed)."),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=1.0, help="With --url: seconds a probe request may take.")
    ] = 120.0,
) -> None:
    """Time real engine steps and fit the step-cost models (TimeBill ETE + batch form);
    with --url, time any OpenAI-compatible server's streamed tokens instead. The profile
    records the engine limits --kv-capacity, --max-num-seqs and --max-batch-tokens (a
    step's prefill and decode tokens together)."""
    probe_only = given_options(ctx, "served_model", "timeout")
    if url is None and probe_only:  # they were ignored, and the engine timed instead
        _fail(f"{', '.join(probe_only)}: only with --url (a server to probe)")
    limits = EngineLimits(
        kv_capacity_tokens=kv_capacity, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens
    )
    if url is not None:
        from duetime.cli.profile_url import profile_url

        if samples_path is not None or plot is not None:
            _fail("--samples and --plot show the embedded engine's timed steps; not with --url")

        profile_url(
            url, model=served_model, quick=quick, out=out, json_path=json_path, limits=limits,
            timeout_s=timeout,
        )  # fmt: skip
        return
    from duetime.cli.profile_engine import profile_engine

    with _user_errors():
        profile_engine(
            dtype=dtype, threads=threads, quick=quick, serve_requests=serve_requests,
            out=out, json_path=json_path, samples_path=samples_path, plot=plot, limits=limits,
        )  # fmt: skip


@app.command()
def validate(
    profile: Annotated[
        str, typer.Option(help="Profile JSON from `duetime profile`.", callback=input_path)
    ] = "out/gemma3-270m-cpu.json",
    policy: Annotated[
        str, typer.Option(help="Policy name, the same on both sides (see `duetime policies`).")
    ] = "fcfs",
    requests: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_ENGINE_REQUESTS,
            help=f"ShareGPT requests, at most {MAX_ENGINE_REQUESTS:,}: hours of real-engine "
            "time already, and the simulator side keeps every record.",
        ),
    ] = 100,
    rate: RateOpt = 2.0,
    seed: Annotated[
        int, typer.Option(min=0, help="Random seed of the ShareGPT sample and its arrivals.")
    ] = 0,
    dtype: DtypeOpt = "q8",  # the engine `duetime serve` runs
    threads: ThreadsOpt = 2,
    max_prompt: Annotated[
        int, typer.Option(min=1, help="Longest prompt, tokens (longer ShareGPT pairs left out).")
    ] = 512,
    max_output: MaxTokensOpt = 128,
    plot: Annotated[
        Path,
        typer.Option(
            "--plot",
            help="Write a PNG here: simulated against real e2e latency per request, and CDFs.",
            callback=output_path,
        ),
    ] = Path("out/validate.png"),
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Write the figures to this JSON file.", callback=output_path),
    ] = None,
    samples_path: Annotated[
        Path | None,
        typer.Option(
            "--samples",
            help="Write the real run's steps here as JSON lines (profile --samples' fields, "
            "source: validate), to price them offline against this or another profile.",
            callback=output_path,
        ),
    ] = None,
    eviction: EvictionOpt = "snapkv",
    predictor: Annotated[
        str,
        typer.Option(
            help="Length predictor, the same on both sides: none, oracle, noisy[:σ], "
            "interval:… or learned[:path] (hsf needs one).",
        ),
    ] = "none",
    floor_runs: Annotated[
        int,
        typer.Option(
            min=0,
            help="Run the same requests on the real engine this many more times: the "
            "per-request error between real runs, the floor the simulator is judged "
            "against (0: skip; each run takes as long as the first).",
        ),
    ] = 1,
) -> None:
    """Same workload through the real engine and the simulator: per-request error."""
    from duetime.bench import validate as v
    from duetime.core.cost import LinearStepCost
    from duetime.engine import load_model
    from duetime.engine.profile import measure_noise, noise_drift_pct, noise_floor_pct, pool_noise
    from duetime.metrics import write_json
    from duetime.predict.cost_report import check_profile_engine, speed_against_profile

    with _user_errors():
        from duetime.engine.gemma3 import DTYPES

        if dtype not in DTYPES:  # before the profile's engine is compared with it
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not Path(profile).exists():
            from duetime.sim.profiles import builtin_profiles

            if profile in builtin_profiles():  # another machine's: nothing to judge here
                raise ValueError(
                    f"--profile {profile} is a shipped profile of another machine; validate "
                    "judges a profile of this engine: `duetime profile --out PATH` makes one"
                )
            raise ValueError(
                f"--profile {profile}: no such file; `duetime profile --out {profile}` makes it"
            )
        if eviction not in ("snapkv", "streaming"):
            raise ValueError(f"--eviction must be snapkv or streaming, got {eviction!r}")
        v.check_policy(policy, predictor)  # before the load: hsf failed only once running
        meta = LinearStepCost.from_profile(profile).meta
        check_profile_engine(meta, profile, dtype, threads)
        _set_threads(threads)
        model = load_model(dtype=dtype)  # type: ignore[arg-type]
        with console.status("repeating identical steps for the noise floor (start)"):
            first = measure_noise(model)
        runs = f"{1 + floor_runs} real runs" if floor_runs else "the real engine"
        with console.status(f"{requests} requests through {runs}, then the simulator"):
            fig = v.run(
                model=model, profile=profile, policy=policy, requests=requests, rate=rate,
                seed=seed, max_prompt=max_prompt, max_output=max_output, plot=plot,
                eviction=eviction, predictor=predictor, floor_runs=floor_runs,
                samples=samples_path,
            )  # fmt: skip
        # what a rerun needs beside the run's own figures
        fig.update(dtype=dtype, threads=threads, seed=seed)
        fig.update(max_prompt_tokens=max_prompt, max_output_tokens=max_output)
        with console.status("repeating identical steps for the noise floor (end)"):
            last = measure_noise(model)
        floor = noise_floor_pct(pool_noise(first, last))
        fig["noise_drift_pct"] = noise_drift_pct(first, last)
        fig["speed_at_start_x"] = speed_against_profile(meta, first)
        fig["speed_at_end_x"] = speed_against_profile(meta, last)
    fig["noise_floor_pct"] = floor
    _judge(fig)
    if json_path is not None:  # before the table: a closed stdout must not lose the file
        with _user_errors():
            write_json(json_path, fig)
    _print_validation(fig)


def _judge(fig: dict[str, Any]) -> None:
    """Add the run's verdict: its median e2e error beside the machine's own (two real
    runs of the same requests) and beside the error left at the run's own speed."""
    from duetime.bench import validate as v

    median = fig["e2e_rel_err_median_pct"]
    e2e_floor = fig["e2e_floor_median_pct"]
    fig["verdict"] = (
        None
        if median is None
        else v.e2e_verdict(
            median, e2e_floor, fig["e2e_at_run_speed_median_pct"], fig["requests_compared"]
        )
    )
    fig["e2e_at_machine_limit"] = (
        None if median is None or e2e_floor is None else median <= e2e_floor
    )


def _print_validation(fig: dict[str, Any]) -> None:
    """The comparison table, the verdict against the target, the error at the run's own
    speed, and the profile's error on the run's own steps beside their floor (with the
    shapes it misses most where it is past the machine's limit)."""
    from duetime.metrics import render_table
    from duetime.predict.cost_report import AT_LIMIT_FACTOR, floor_verdict

    floor = fig["noise_floor_pct"]
    skip = ("verdict", "step_misses")
    console.print(render_table([("real vs sim", fig)], keys=[k for k in fig if k not in skip]))
    console.print(
        f"{fig['verdict']}\n"
        "target: median e2e error <= 5 %, p90 <= 10 % (Vidur: < 9 % against real GPUs)"
    )
    if fig["e2e_at_run_speed_median_pct"] is not None:
        console.print(
            f"the profile scaled to this run's speed (its steps took "
            f"{fig['step_seconds_real_over_model']:.2f}x the profile's): median e2e error "
            f"{fig['e2e_at_run_speed_median_pct']:.1f} %, p90 {fig['e2e_at_run_speed_p90_pct']:.1f}"
            " %: what is left once the machine's speed level is taken out"
        )
    step_error = fig["step_mape_pct"]
    if step_error is not None:
        repeat = fig["step_repeat_floor_pct"]
        step_floor = floor if repeat is None else max(floor, repeat)
        ratio = fig["step_seconds_real_over_model"]
        in_sum = "-" if ratio is None else f"{ratio:.2f}x"
        console.print(
            f"the profile on this run's {fig['real_steps']} steps: "
            f"{floor_verdict(step_error, step_floor)} (the floor: the larger of identical "
            f"steps repeated before and after the run, {floor:.1f} %, whose median moved "
            f"{fig['noise_drift_pct']:.1f} %, and the run's own steps of one shape, "
            f"{pct_text(repeat)} spread over {fig['step_repeat_floor_steps']} steps; the run's "
            f"steps took {in_sum} the profile's in sum)"
        )
        if step_error > AT_LIMIT_FACTOR * step_floor:
            print_misses(fig["step_misses"], "this run's steps")
