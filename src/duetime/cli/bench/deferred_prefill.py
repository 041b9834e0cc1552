"""`duetime bench deferred-prefill`: throughput vs departure threshold K (Theorem 1).

Analytic and simulated by default; ``--engine`` adds the real engine's curve.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.bench import options as opt
from duetime.cli.bench.model import EngineChoice, step_cost_note
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, out
from duetime.comma_lists import comma_numbers


@bench_app.command("deferred-prefill")
def bench_deferred_prefill(
    requests: Annotated[
        int | None, typer.Option(min=1, help="Requests per run [2000; --engine: 80].")
    ] = None,
    capacity: Annotated[
        int | None,
        typer.Option(min=2, help="Batch capacity C, >= 2 for a curve over K [256; --engine: 16]."),
    ] = None,
    profile: opt.EngineProfileOpt = None,
    seed: opt.SeedOpt = 0,
    workers: opt.WorkersOpt = 2,
    engine: Annotated[
        bool,
        typer.Option("--engine", help="Analytic, simulated and real curves for the real engine."),
    ] = False,
    model: opt.EngineModelOpt = None,
    dtype: opt.EngineDtypeOpt = None,
    threads: opt.EngineThreadsOpt = None,
    clock: opt.EngineClockOpt = None,
    prompt_len: Annotated[
        int | None, typer.Option(min=2, help="--engine: prompt tokens d0 [16].")
    ] = None,
    mean_output: Annotated[
        float | None, typer.Option(help="--engine: mean output tokens, first included [9].")
    ] = None,
    ks: Annotated[
        str | None, typer.Option(help="--engine: departure thresholds, e.g. 1,2,4,8 [+ K*].")
    ] = None,
    reps: Annotated[
        int | None, typer.Option(min=1, help="--engine: interleaved runs per K, medians [1].")
    ] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = Path("out/bench-deferred-prefill.png"),
) -> None:
    """Throughput vs departure threshold K: analytic (Theorem 1), simulated and (--engine) real."""
    from duetime.bench import deferred_prefill as bench

    others = {"--ks": ks, "--prompt-len": prompt_len, "--reps": reps, "--mean-output": mean_output}
    choice = EngineChoice.if_engine(engine, model, dtype, threads, clock, others)
    if choice is not None:
        with _user_errors():
            fig = run_engine(
                choice,
                capacity=capacity or 16, prompt_len=prompt_len or 16,
                mean_output=mean_output or 9.0, requests=requests or 80, ks=ks,
                profile=profile, seed=seed, reps=reps or 1,
            )  # fmt: skip
        save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)
        return
    profile = profile or "a100-llama2-7b"
    with _user_errors():
        fig = bench.run(requests or 2000, capacity or 256, profile, seed, workers)
    out.print(bench.table(fig))
    out.print(k_star_line(fig["advice"]))
    for curve, s in fig["summary"].items():
        best = f"; analytic ρ(K*) {s['analytic_k_star_throughput_vs_best_pct']:+.1f} % of the best"
        out.print(curve_line(curve, s, best))
    out.print(f"real engine: not run (--engine adds it); wall {fig['wall_s']:.1f} s")
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)


def k_star_line(adv: Mapping[str, Any]) -> str:
    """Theorem 1's optimum K* (Proposition 1's approximation beside it) and its gain over
    K = 1: the simulated and the engine runs print their analytic advice alike."""
    return (
        f"analytic K* = {adv['k_star']} (approximation: {adv['k_star_approx']}), "
        f"ρ(K*) = {adv['throughput_k_star_req_s']:.3f} req/s, "
        f"{adv['gain_vs_k1_pct']:+.1f} % vs K = 1"
    )


def curve_line(curve: str, s: Mapping[str, Any], extra: str) -> str:
    """One curve's summary line: its best K against K = 1, ``extra``, its worst error vs
    Theorem 1; the simulated and the engine runs print the same figures around their own."""
    return (
        f"{curve}: best K = {s['k_best']}, {s['gain_best_vs_k1_pct']:+.1f} % throughput and "
        f"{s['completion_change_best_vs_k1_pct']:+.1f} % completion time vs K = 1{extra}; "
        f"max |error| vs Theorem 1 {s['max_abs_error_vs_theorem1_pct']:.1f} %"
    )


def parse_ks(ks: str | None) -> tuple[int, ...] | None:
    """``"1,2,4"`` → ``(1, 2, 4)``; None: the default thresholds."""
    return None if ks is None else tuple(comma_numbers("--ks", ks, int, "integers"))


def run_engine(
    choice: EngineChoice,
    *,
    capacity: int,
    prompt_len: int,
    mean_output: float,
    requests: int,
    ks: str | None,
    profile: str | None,
    seed: int,
    reps: int = 1,
) -> dict[str, Any]:
    """Run the real-engine deferred-prefill curve and print its table and summary.

    The options are checked before the model loads, so a typo costs no load;
    the model's context is read from its config without loading the weights.
    """
    from duetime.bench import deferred_prefill_engine as bench

    sizes = {"capacity": capacity, "prompt_len": prompt_len, "mean_output": mean_output,
             "requests": requests, "ks": parse_ks(ks), "seed": seed}  # fmt: skip
    checks = {**sizes, "reps": reps, "timed": profile is None}
    fig = choice.run_bench(bench, checks=checks, profile=profile, reps=reps, **sizes)
    out.print(bench.table(fig))
    adv = fig["advice"]
    out.print(
        f"{step_cost_note(fig['cost_fit'])}; c_p = {adv['model_c_p_s'] * 1e3:.1f} ms, "
        f"t_p·d0/N = {adv['model_prefill_per_prompt_s'] * 1e3:.1f} ms, "
        f"c_d = {adv['model_c_d_s'] * 1e3:.1f} ms, t_d = {adv['model_t_d_s'] * 1e3:.2f} ms"
    )
    out.print(k_star_line(adv))
    for curve, s in fig["summary"].items():
        star = (
            f"; at K* {s['gain_k_star_vs_k1_pct']:+.1f} % throughput, "
            f"{s['completion_change_k_star_vs_k1_pct']:+.1f} % completion"
            if "gain_k_star_vs_k1_pct" in s
            else ""
        )
        out.print(curve_line(curve, s, star))
    out.print(
        f"paper (vLLM, A100): +13.5 % throughput, -14 % completion time at its best K; "
        f"wall {fig['wall_s']:.1f} s (a shared machine: the real curve is noisy; "
        "--clock cpu counts only this process's CPU seconds)"
    )
    return fig
