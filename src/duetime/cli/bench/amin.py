"""`duetime bench amin`: Amax / Amin vs H-SF, simulated or (``--engine``) on the real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.bench import options as opt
from duetime.cli.bench.model import EngineChoice, step_cost_note
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, out
from duetime.cli.paths import input_list
from duetime.comma_lists import comma_list


@bench_app.command("amin")
def bench_amin(
    requests: Annotated[
        int | None, typer.Option(min=1, help="ShareGPT requests [2000; --engine: 12].")
    ] = None,
    kv_capacity: Annotated[
        int | None, typer.Option(min=1, help="KV memory M, tokens [111000; --engine: 224].")
    ] = None,
    profile: opt.EngineProfileOpt = None,
    seed: opt.SeedOpt = 0,
    workers: opt.WorkersOpt = 2,
    two_point: Annotated[
        bool, typer.Option(help="Also check A_ℓ and Amin on two-point lengths.")
    ] = True,
    learned: Annotated[
        str,
        typer.Option(
            help="Also run Amax / Amin on trained length predictors' intervals (held-out rows, "
            "beside H-SF on them), comma-separated: learned (the default model), "
            "learned:minilm-ft (a shipped one), learned:<model file>; '' for none.",
            callback=input_list,
        ),
    ] = "learned",
    engine: Annotated[
        bool, typer.Option("--engine", help="Run H-SF/Amax/Amin on the real engine instead.")
    ] = False,
    model: opt.EngineModelOpt = None,
    dtype: opt.EngineDtypeOpt = None,
    threads: opt.EngineThreadsOpt = None,
    clock: opt.EngineClockOpt = None,
    max_prompt: Annotated[
        int | None, typer.Option(min=2, help="--engine: prompt cap, tokens [256].")
    ] = None,
    max_output: Annotated[
        int | None, typer.Option(min=1, help="--engine: output cap, tokens [48].")
    ] = None,
    intervals: Annotated[
        str | None, typer.Option(help="--engine: constructions, e.g. overlap-0.95,rough.")
    ] = None,
    engine_reps: Annotated[
        int | None,
        typer.Option("--reps", min=1, help="--engine: interleaved runs per policy, medians [1]."),
    ] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = Path("out/bench-amin.png"),
) -> None:
    """Amax / Amin vs H-SF per prediction-interval construction (Chen, Ye, Zhou 2025)."""
    from duetime.bench import amin as bench
    from duetime.bench import amin_report as report

    others = {"--max-prompt": max_prompt, "--max-output": max_output, "--intervals": intervals,
              "--reps": engine_reps}  # fmt: skip
    choice = EngineChoice.if_engine(engine, model, dtype, threads, clock, others)
    if choice is not None:
        with _user_errors():
            fig = run_engine(
                choice,
                requests=requests or 12, kv_capacity=kv_capacity or 224,
                max_prompt=max_prompt or 256, max_output=max_output or 48,
                intervals=intervals or "overlap-0.95", profile=profile, seed=seed, plot=plot,
                reps=engine_reps or 1,
            )  # fmt: skip
        save_figures(fig, json_path=json_path)
        return
    profile = profile or "a100-llama2-7b"
    with _user_errors():
        specs = comma_list(learned)
        fig = bench.run(
            requests or 2000, seed, kv_capacity or 111_000, profile, workers, two_point, specs
        )
    w = fig["workload"]
    out.print(
        f"{w['requests']:,} ShareGPT requests at t = 0 (prompt mean {w['prompt_tokens_mean']:.0f}, "
        f"output mean {w['output_tokens_mean']:.0f} tokens, <= 1,000); the paper used "
        f"LMSYS-Chat-1M; unit = 1 step per time unit, linear = profile {profile}"
    )
    out.print(report.table(fig))
    for spec, li in fig["learned_intervals"].items():
        out.print(
            f"{spec} intervals on {li['requests']:,} held-out requests: "
            f"{li['coverage']:.1%} hold the truth ({li['below_lo_share']:.1%} fall below lo), "
            f"mean width {li['interval_width_mean_tokens']:.0f} tokens, median α = lo/hi "
            f"{li['alpha_median']:.3f}"
        )
    if fig["two_point"]:
        out.print(report.two_point_table(fig))
    out.print(f"wall {fig['wall_s']:.1f} s")
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=report.plot)


def run_engine(
    choice: EngineChoice,
    *,
    requests: int,
    kv_capacity: int,
    max_prompt: int,
    max_output: int,
    intervals: str,
    profile: str | None,
    seed: int,
    plot: Path | None,
    reps: int = 1,
) -> dict[str, Any]:
    """Run H-SF / Amax / Amin on the engine beside the simulator; print the table.

    Checks the options (interval names, --requests, the fit of every request in
    --kv-capacity and in the model's context) before the model loads, so a typo
    costs no load.
    """
    from duetime.bench import amin_engine as bench

    constructions = tuple(comma_list(intervals))
    sizes = {"requests": requests, "kv_capacity": kv_capacity, "max_prompt": max_prompt,
             "max_output": max_output, "constructions": constructions, "seed": seed}  # fmt: skip
    fig = choice.run_bench(bench, checks=sizes, profile=profile, reps=reps, **sizes)
    out.print(bench.table(fig))
    w = fig["workload"]
    out.print(
        f"{step_cost_note(fig['cost_fit'])}; prompts mean {w['prompt_tokens_mean']:.0f} "
        f"(<= {w['max_prompt_tokens']}), outputs mean {w['output_tokens_mean']:.0f} "
        f"(<= {w['max_output_tokens']}) tokens; wall {fig['wall_s']:.1f} s "
        "(a shared machine: real TEL is noisy)"
    )
    if plot is not None:  # here, inside the command's error handling, as the simulator's is
        bench.plot(fig, plot)
    return fig
