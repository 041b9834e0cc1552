"""Real-engine commands: `duetime profile` and `duetime validate`."""

from __future__ import annotations

import dataclasses
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from duetime.bench.limits import MAX_ENGINE_REQUESTS
from duetime.cli.common import (
    DtypeOpt,
    EvictionOpt,
    PlotOpt,
    ThreadsOpt,
    _fail,
    _progress,
    _user_errors,
    app,
    pct_text,
    writable,
)
from duetime.cli.common import out as console


def _print_misses(
    rows: list[dict[str, object]], what: str = "held-out steps", top: int = 8
) -> None:
    """The step shapes the model misses most, as a small table."""
    console.print(f"where the model misses most ({what}, by share of the error):")
    head = (
        f"  {'decoders':>9} {'prompt tok':>10} {'steps':>6} {'MAPE %':>7} {'median %':>9} "
        f"{'share %':>8}"
    )
    console.print(head)
    for r in rows[:top]:
        console.print(
            f"  {r['decoders']!s:>9} {r['prompt_tokens']!s:>10} {r['steps']!s:>6} "
            f"{float(r['mape_pct']):>7.1f} {float(r['median_error_pct']):>+9.1f} "  # type: ignore[arg-type]
            f"{float(r['error_share_pct']):>8.1f}"  # type: ignore[arg-type]
        )


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


@app.command()
def profile(
    dtype: DtypeOpt = "q8",  # the engine `duetime serve` runs
    threads: ThreadsOpt = 2,
    quick: Annotated[bool, typer.Option(help="A small grid (smoke test).")] = False,
    out: Annotated[
        Path, typer.Option("--out", help="Profile JSON to write.", callback=writable)
    ] = Path("out/gemma3-270m-cpu.json"),
    kv_capacity: Annotated[
        int, typer.Option(min=1, help="KV tokens recorded in the profile.")
    ] = 32_768,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 64,
    max_batch_tokens: Annotated[int, typer.Option(min=1)] = 2048,
    serve_requests: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also fit to the steps of a short serving run of this many ShareGPT "
            "requests (seed 1; 0: the grid only; --quick: at most 4).",
        ),
    ] = 40,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report here.", callback=writable)
    ] = None,
    samples_path: Annotated[
        Path | None,
        typer.Option(
            "--samples",
            help="Write every timed step here as JSON lines (the executor's telemetry "
            "fields, and source: grid or serving), to refit or compare offline.",
            callback=writable,
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
    with --url, time any OpenAI-compatible server's streamed tokens instead."""
    if url is not None:
        from duetime.cli.profile_url import profile_url

        if samples_path is not None or plot is not None:
            _fail("--samples and --plot show the embedded engine's timed steps; not with --url")

        profile_url(
            url, model=served_model, quick=quick, out=out, json_path=json_path,
            kv_capacity=kv_capacity, max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens, timeout_s=timeout,
        )  # fmt: skip
        return
    from duetime.core.cost import LinearStepCost
    from duetime.engine import load_model
    from duetime.engine.cost_regimes import regimes_of
    from duetime.engine.profile import (
        ProfileGrid,
        measure_evictions,
        measure_noise,
        measure_steps,
        noise_drift_pct,
        noise_floor_pct,
        pool_noise,
        serving_steps,
    )
    from duetime.engine.step_samples import write_steps
    from duetime.metrics import write_json
    from duetime.predict.cost_report import engine_of, profile_payload, repeat_floor_pct

    with _user_errors():
        from duetime.engine.gemma3 import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        _set_threads(threads)
        t0 = time.perf_counter()
        model = load_model(dtype=dtype)  # type: ignore[arg-type]
        load_s = time.perf_counter() - t0
        grid = ProfileGrid.quick() if quick else ProfileGrid()
        noise_reps = 4 if quick else 15
        t0 = time.perf_counter()
        with console.status("repeating identical steps for the noise floor (start)"):
            noise_first = measure_noise(model, reps=noise_reps)
        prog, cb = _progress(1, "profiling")
        with prog:
            samples = measure_steps(model, grid, progress=cb)
        grid_steps = len(samples)
        if serve_requests:
            # --quick serves at most 4 short requests: say how many really run.
            n_serve = min(serve_requests, 4) if quick else serve_requests
            note = f" (--quick: {serve_requests} asked)" if n_serve != serve_requests else ""
            with console.status(f"serving {n_serve} ShareGPT requests{note} for in-situ steps"):
                samples += serving_steps(
                    model,
                    requests=n_serve,
                    max_prompt=32 if quick else 256,
                    max_output=8 if quick else 64,
                )
        evictions = measure_evictions(model, (32, 64) if quick else (128, 256, 512))
        with console.status("repeating identical steps for the noise floor (end)"):
            noise_last = measure_noise(model, reps=noise_reps)
        noise = pool_noise(noise_first, noise_last)
        measure_s = time.perf_counter() - t0
        name = f"gemma3-270m-cpu-{dtype}-t{threads}"
        source = (
            f"measured by `duetime profile` on {platform.node()} ({platform.machine()}, "
            f"{threads} torch threads, {dtype}) at "
            f"{datetime.now(UTC).isoformat(timespec='seconds')}: {len(samples)} timed steps "
            f"({grid_steps} of the grid, {len(samples) - grid_steps} of a serving run)"
        )
        payload = profile_payload(
            samples,
            name=name,
            source=source,
            kv_capacity_tokens=kv_capacity,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            regimes=regimes_of(model),
            noise_floor_pct=noise_floor_pct(noise),
            noise=[dataclasses.asdict(n) for n in noise],
            noise_drift_pct=noise_drift_pct(noise_first, noise_last),
            repeat_floor=repeat_floor_pct(samples[grid_steps:])[0],
            evictions=evictions,
            engine=engine_of(dtype, threads),
        )
        write_json(out, payload)
        if samples_path is not None:
            sources = ["grid"] * grid_steps + ["serving"] * (len(samples) - grid_steps)
            write_steps(samples_path, samples, sources)
        if plot is not None:
            from duetime.predict.cost_plot import plot_step_fit

            plot_step_fit(
                LinearStepCost.from_dict(payload, str(out)), samples, plot,
                floor_pct=payload["verdict_floor_pct"],  # type: ignore[arg-type]
                title=f"{name}: every timed step, the fit of all",
            )  # fmt: skip
    held = payload["heldout"]
    assert isinstance(held, dict)
    coeffs = payload["coefficients"]
    assert isinstance(coeffs, dict)
    cost_e = coeffs["e"]  # fitted from the timed evictions
    report = {
        "profile": str(out),
        "load_s": load_s,
        "measure_s": measure_s,
        "samples": len(samples),
        "grid_samples": grid_steps,
        "serving_samples": len(samples) - grid_steps,
        "batch_model_mape_pct": held["batch_model_mape_pct"],
        "model_prefill_mape_pct": held["model_prefill_mape_pct"],
        "model_decode_mape_pct": held["model_decode_mape_pct"],
        "model_mixed_mape_pct": held["model_mixed_mape_pct"],
        "ete_prefill_mape_pct": held["ete_prefill_mape_pct"],
        "ete_decode_mape_pct": held["ete_decode_mape_pct"],
        "noise_floor_pct": payload["noise_floor_pct"],
        "noise_drift_pct": payload["noise_drift_pct"],
        "repeat_floor_pct": payload["repeat_floor_pct"],
        "verdict_floor_pct": payload["verdict_floor_pct"],
        "noise": payload["noise"],
        "verdict": payload["verdict"],
        "at_noise_limit": payload["at_noise_limit"],
        "regimes": payload.get("regimes"),
        "attention": payload.get("attention"),
        "misses": payload["misses"],
        "eviction_s_per_kv_token": cost_e,
        "eviction_ms_at_max_len": 1e3 * max(evictions)[1] if evictions else None,
    }
    console.print(
        f"profiled {len(samples)} steps in {measure_s:.1f} s (model load {load_s:.1f} s)\n"
        f"held-out MAPE, step-cost model: all {pct_text(held['batch_model_mape_pct'])}, prompts "
        f"{pct_text(held['model_prefill_mape_pct'])}, "
        f"decodes {pct_text(held['model_decode_mape_pct'])}, "
        f"mixed {pct_text(held['model_mixed_mape_pct'])}; TimeBill's ETE form: whole prompts "
        f"{pct_text(held['ete_prefill_mape_pct'])}, one-sequence decodes "
        f"{pct_text(held['ete_decode_mape_pct'])}\n"
        f"{payload['verdict']} (the floor: the larger of identical steps repeated at the "
        f"start and the end, whose median moved {pct_text(payload['noise_drift_pct'])}, and the "
        f"serving run's steps of one shape, {pct_text(payload['repeat_floor_pct'])} spread)\n"
        f"SnapKV eviction {1e6 * cost_e:.1f} µs per KV token held"
    )
    shape = payload.get("attention")
    if isinstance(shape, dict):
        console.print(
            f"prompt attention counted as the kernels compute it: {shape['sliding_layers']} "
            f"of {shape['layers']} layers see the last {shape['window']} keys, a chunk of more "
            f"than {shape['block']} rows runs in blocks"
        )
    if payload["at_noise_limit"] is False:
        _print_misses(report["misses"])
    written = [str(p) for p in (out, samples_path, plot) if p is not None]
    console.print(f"wrote {', '.join(written)}")
    if json_path is not None:
        write_json(json_path, report)


@app.command()
def validate(
    profile: Annotated[str, typer.Option(help="Profile JSON from `duetime profile`.")] = (
        "out/gemma3-270m-cpu.json"
    ),
    policy: Annotated[str, typer.Option()] = "fcfs",
    requests: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_ENGINE_REQUESTS,
            help=f"ShareGPT requests, at most {MAX_ENGINE_REQUESTS:,}: hours of real-engine "
            "time already, and the simulator side keeps every record.",
        ),
    ] = 100,
    rate: Annotated[float, typer.Option(min=0.0)] = 2.0,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    dtype: DtypeOpt = "q8",  # the engine `duetime serve` runs
    threads: ThreadsOpt = 2,
    max_prompt: Annotated[int, typer.Option(min=1)] = 512,
    max_output: Annotated[int, typer.Option(min=1)] = 128,
    plot: Annotated[Path, typer.Option("--plot", callback=writable)] = Path("out/validate.png"),
    json_path: Annotated[Path | None, typer.Option("--json", callback=writable)] = None,
    samples_path: Annotated[
        Path | None,
        typer.Option(
            "--samples",
            help="Write the real run's steps here as JSON lines (profile --samples' fields, "
            "source: validate), to price them offline against this or another profile.",
            callback=writable,
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
    from duetime.engine.profile import (
        measure_noise,
        noise_drift_pct,
        noise_floor_pct,
        pool_noise,
    )
    from duetime.metrics import render_table, write_json
    from duetime.predict.cost_report import (
        AT_LIMIT_FACTOR,
        check_profile_engine,
        floor_verdict,
        speed_against_profile,
    )

    with _user_errors():
        if not Path(profile).exists():
            raise ValueError(f"{profile}: no such profile; run `duetime profile --out {profile}`")
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
        with console.status("repeating identical steps for the noise floor (end)"):
            last = measure_noise(model)
        floor = noise_floor_pct(pool_noise(first, last))
        fig["noise_drift_pct"] = noise_drift_pct(first, last)
        fig["speed_at_start_x"] = speed_against_profile(meta, first)
        fig["speed_at_end_x"] = speed_against_profile(meta, last)
    median = fig["e2e_rel_err_median_pct"]
    fig["noise_floor_pct"] = floor
    e2e_floor = fig["e2e_floor_median_pct"]
    fig["verdict"] = (
        None
        if median is None
        else v.e2e_verdict(median, e2e_floor, fig["e2e_at_run_speed_median_pct"])
    )
    fig["e2e_at_machine_limit"] = (
        None if median is None or e2e_floor is None else median <= e2e_floor
    )
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
            _print_misses(fig["step_misses"], "this run's steps")
    if json_path is not None:
        write_json(json_path, fig)
