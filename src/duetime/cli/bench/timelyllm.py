"""`duetime bench timelyllm`: TimelyLLM vs vLLM-style baselines on LRTrace.

Simulated at full scale by default; ``--engine`` runs a few tasks on the real
engine, time-scaled to its speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.bench.model import load_engine
from duetime.cli.bench.options import (
    EngineThreadsOpt,
    FastEngineDtypeOpt,
    SeedOpt,
    no_engine_options,
)
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, err, out
from duetime.cli.paths import input_path


@bench_app.command("timelyllm")
def bench_timelyllm(
    wid: Annotated[
        list[int] | None, typer.Option(help="An LRTrace workload, 1-3; repeat for several.")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="'paper-rtx4090' (modelled on the paper) or a shipped profile [paper-rtx4090]; "
            "--engine: this engine's step costs (a `duetime profile` JSON) instead of timing "
            "them.",
            callback=input_path,
        ),
    ] = None,
    kv_capacity: Annotated[int | None, typer.Option(min=1, help="KV tokens (contention).")] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(min=1, help="Batch-size cap (the paper's Fig. 7 knob).")
    ] = None,
    offload: Annotated[
        bool, typer.Option(help="Page suspended KV out when a step needs the room (§4.1).")
    ] = True,
    engine: Annotated[
        bool,
        typer.Option(help="Run on the real engine (Gemma 3 270M), small scale, time-scaled."),
    ] = False,
    requests: Annotated[
        int | None, typer.Option(min=2, help="--engine: tasks per workload [16].")
    ] = None,
    dtype: FastEngineDtypeOpt = None,
    threads: EngineThreadsOpt = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            help="--engine: reuse an earlier --engine JSON's cost and scale (same jobs).",
            callback=input_path,
        ),
    ] = None,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """TimelyLLM vs vLLM, vLLM-stream, segmented FCFS/EDF on LRTrace WID1-3.

    Simulated at full scale by default; `--engine` runs a few tasks on the real
    engine (default WID2, 16 tasks), time-scaled to its speed.
    """
    from duetime.bench import timelyllm as bench

    wids = tuple(wid or ((2,) if engine else (1, 2, 3)))
    if any(w not in (1, 2, 3) for w in wids):
        raise typer.BadParameter("--wid must be 1, 2 or 3")
    if engine:
        run_engine(
            wids=wids,
            requests=requests or 16,
            seed=seed,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            offload=offload,
            dtype=dtype or "fast",
            threads=threads or 1,
            json_path=json_path,
            plot=plot,
            calibration=calibration,
            profile=profile,
        )
        return
    no_engine_options(
        {"--requests": requests, "--dtype": dtype, "--threads": threads,
         "--calibration": calibration}
    )  # fmt: skip
    with _user_errors():
        fig = bench.run(wids, seed, profile or "paper-rtx4090", kv_capacity, max_num_seqs, offload)
    out.print(bench.table(fig))
    print_summary(fig)
    oh = fig["overhead"]
    out.print(
        "scheduling overhead: "
        + ", ".join(f"{k.split('_')[-1]} tasks {v:.3f} ms" for k, v in oh.items())
        + " (paper: 2.03 ms for 8)"
    )
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)


def _x(v: float | None) -> str:
    return "n/a (baseline total <= 0)" if v is None else f"{v:.2f}x"


def print_summary(fig: dict[str, Any]) -> None:
    """One line per workload: TimelyLLM's gain over vLLM and the paper's best."""
    for w, s in fig["summary"].items():
        out.print(
            f"{w}: timelyllm utility {_x(s['utility_gain_vs_fcfs_x'])} vs vllm "
            f"(best class {_x(s['utility_gain_best_class_x'])}; paper: up to 1.97x), "
            f"waiting {s['waiting_change_vs_fcfs_pct']:+.0f} % "
            f"(best class {s['waiting_change_best_class_pct']:+.0f} %; paper: -84 %)"
        )


def run_engine(
    *,
    wids: tuple[int, ...],
    requests: int,
    seed: int,
    kv_capacity: int | None,
    max_num_seqs: int | None,
    offload: bool,
    dtype: str,
    threads: int,
    json_path: Path | None,
    plot: Path | None,
    calibration: Path | None = None,
    profile: str | None = None,
) -> None:
    """Load Gemma 3 270M, calibrate, run the five systems on scaled LRTrace tasks, report.

    ``calibration``: reuse the cost and scale of an earlier run's JSON, so two runs
    (offload on and off, say) serve the same jobs. ``profile``: take the step
    costs from a profile instead of timing them (the scale follows from them).
    Every option, and the fit of each task in the KV capacity, is checked
    before the model loads.
    """
    from duetime.bench import timelyllm as sim_bench
    from duetime.bench import timelyllm_engine as bench
    from duetime.bench.engine_fit import check_dtype

    kv_capacity = kv_capacity or 8192
    with _user_errors():
        # Checked here too (the loader checks it) so a bad --dtype fails before a
        # bad --calibration file does, as it always has.
        check_dtype(dtype)
        if calibration is not None and profile is not None:
            raise ValueError(
                "--calibration and --profile both give the engine's step costs; pick one"
            )
        calib = bench.calibration_from_json(calibration) if calibration is not None else None
        if profile is not None:
            from duetime.predict.cost_report import check_profile_engine

            calib = bench.calibration_from_profile(profile)
            check_profile_engine(calib[0].meta, profile, dtype, threads)
        bench.check_fits(wids, requests, seed, kv_capacity, calib[1] if calib else None)
        model = load_engine("gemma", dtype, threads)
        if calib is None:
            err.print("calibrating the step cost (a few dozen timed steps)...")
        fig = bench.run(
            model,
            wids=wids,
            requests=requests,
            seed=seed,
            max_num_seqs=max_num_seqs or 16,
            kv_capacity=kv_capacity,
            offload=offload,
            calibration=calib,
            progress=lambda s: err.print(f"running {s} on the engine"),
        )
    fig["dtype"] = dtype
    fig["torch_threads"] = threads
    fig["calibration_from"] = (
        str(calibration) if calibration is not None else f"profile {profile}" if profile else None
    )
    sc = fig["scale"]
    out.print(sim_bench.table(fig))
    print_summary(fig)
    out.print(
        f"scaling: time x{sc['time_x']:.2f} (decode step {1e3 * sc['decode_step_s']:.1f} ms vs "
        f"the paper's 21.5 ms), prompts x{sc['prompt_x']:.3f}; engine wall "
        f"{sum(r['wall_s'] for r in fig['rows']):.0f} s for {len(fig['rows'])} runs"
    )
    sim = {(r["wid"], r["system"]): r for r in fig["simulated_same_jobs"]["rows"]}
    out.print(
        "simulator on the same jobs (utility total): "
        + ", ".join(
            f"WID{r['wid']} {r['system']} {sim[r['wid'], r['system']]['time_utility_total']:.1f}"
            f" (engine {r['time_utility_total']:.1f})"
            for r in fig["rows"]
        )
    )
    title = (
        f"TimelyLLM vs baselines on the real engine\n(Gemma 3 270M {dtype}, "
        f"{requests} tasks, time x{sc['time_x']:.2f})"
    )
    save_figures(
        fig,
        json_path=json_path,
        plot=plot,
        plot_fn=lambda f, p: sim_bench.plot(f, p, title=title),
    )
