"""`duetime bench timebill`: TimeBill vs fixed-α eviction, Kill and Skip-Next.

Simulated by default; ``--engine`` runs the real engine (small scale, minutes)
and scores the answers (F1 / ROUGE-L), which the simulator has no text for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.bench.model import load_engine
from duetime.cli.bench.options import FastEngineDtypeOpt, SeedOpt, no_engine_options
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _fail, _user_errors, bench_app, out
from duetime.cli.paths import input_path
from duetime.comma_lists import comma_list

MODELS = ("gemma", "tiny")


@bench_app.command("timebill")
def bench_timebill(
    jobs: Annotated[
        int | None, typer.Option(min=1, help="Periodic jobs per run (simulator) [200].")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Shipped profile name or JSON path [a100-llama2-7b]; with --engine a "
            "`duetime profile` JSON [default: time this workload's steps].",
            callback=input_path,
        ),
    ] = None,
    predictor: Annotated[
        str | None,
        typer.Option(
            help="Length predictor: noisy[:σ], oracle, learned[:path] [noisy; --engine: learned].",
            callback=input_path,
        ),
    ] = None,
    tasks: Annotated[int, typer.Option(min=1, help="Concurrent periodic tasks.")] = 1,
    rows: Annotated[
        str,
        typer.Option(
            help="ShareGPT rows the jobs come from: all, or heldout (only those no shipped "
            "length predictor trained on, each once: at most 87 jobs; the fair draw for "
            "--predictor learned)."
        ),
    ] = "all",
    budget: Annotated[
        list[float] | None, typer.Option(help="Time budget(s) T in s; default: paper's, scaled.")
    ] = None,
    seed: SeedOpt = 0,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine", help="On the real engine (small scale, minutes), with F1 / ROUGE-L scores."
        ),
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="--engine: gemma (default) or tiny (random weights).")
    ] = None,
    dtype: FastEngineDtypeOpt = None,
    threads: Annotated[int | None, typer.Option(min=1, help="--engine: torch threads [2].")] = None,
    prompts: Annotated[int | None, typer.Option(min=1, help="--engine: ShareGPT prompts [6].")] = (
        None
    ),
    n_max: Annotated[
        int | None, typer.Option(min=2, help="--engine: N_max, output tokens cap [32].")
    ] = None,
    min_prompt: Annotated[
        int | None, typer.Option(min=1, help="--engine: shortest prompt, tokens [256].")
    ] = None,
    max_prompt: Annotated[
        int | None, typer.Option(min=1, help="--engine: longest prompt, tokens [512].")
    ] = None,
    method: Annotated[
        list[str] | None,
        typer.Option(help="--engine: methods to run, comma-separated or repeated [all seven]."),
    ] = None,
    budget_scale: Annotated[
        str | None,
        typer.Option(
            help="--engine: job (median full-KV job = 7.5 s) or step (decode step / 27 ms) [job]."
        ),
    ] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = Path("out/bench-timebill.png"),
) -> None:
    """TimeBill vs vanilla and fixed-α KV eviction, Kill and Skip-Next (simulated or --engine)."""
    from duetime.bench import timebill as bench

    engine_only = {
        "--model": model, "--dtype": dtype, "--threads": threads, "--prompts": prompts,
        "--n-max": n_max, "--min-prompt": min_prompt, "--max-prompt": max_prompt,
        "--method": method, "--budget-scale": budget_scale,
    }  # fmt: skip
    if engine:
        if jobs is not None:
            _fail("--jobs is for the simulator; with --engine use --prompts")
        if tasks != 1:
            _fail("--engine runs one periodic task; drop --tasks")
        if rows != "all":
            _fail("--rows is for the simulator; --engine draws its own prompts")
        with _user_errors():
            run_engine(
                model=model or "gemma", dtype=dtype or "fast", threads=threads or 2,
                prompts=prompts or 6, n_max=n_max or 32, min_prompt=min_prompt or 256,
                max_prompt=max_prompt or 512, methods=method, budgets=budget,
                budget_scale=budget_scale or "job", predictor=predictor or "learned",
                profile=profile, seed=seed, json_path=json_path, plot=plot,
            )  # fmt: skip
        return
    no_engine_options(engine_only)
    with _user_errors():
        fig = bench.run(
            jobs or 200, seed, profile or "a100-llama2-7b", predictor or "noisy", tasks,
            tuple(budget or ()), rows=rows,
        )  # fmt: skip
    w = fig["workload"]
    out.print(
        f"{w['jobs']} ShareGPT jobs ({w['rows']} rows) with prompts >= {bench.MIN_PROMPT} tokens "
        f"(mean {w['prompt_tokens_mean']:.0f}, max {w['prompt_tokens_max']}), outputs <= "
        f"{fig['n_max_tokens']} (mean {w['output_tokens_mean']:.0f}); period = budget T"
    )
    for t in bench.table(fig):
        out.print(t)
    for o, s in fig["summary"].items():
        tb, va, a95 = s["timebill"], s["vanilla"], s["alpha=95%"]
        out.print(
            f"{o}: completion (mean over budgets) timebill {100 * tb['completion_rate_mean']:.1f} %"
            f" (mean α {100 * tb['mean_alpha_mean']:.0f} %), vanilla "
            f"{100 * va['completion_rate_mean']:.1f} %, alpha=95% "
            f"{100 * a95['completion_rate_mean']:.1f} % (paper: timebill ~ alpha=95%)"
        )
    out.print(
        "no response-quality score: the simulator has no text (F1 / ROUGE-L: run with "
        f"--engine); wall {fig['wall_s']:.1f} s"
    )
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)


def load(model: str, dtype: str, threads: int) -> Any:
    """The packaged Gemma 3 270M (``gemma``) or a tiny random-weight one (``tiny``: tests).

    Narrower than the shared loader: no GGUF path.
    """
    from duetime.engine.gemma3 import DTYPES

    if model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return load_engine(model, dtype, threads)


def run_engine(
    *,
    model: str,
    dtype: str,
    threads: int,
    prompts: int,
    n_max: int,
    min_prompt: int,
    max_prompt: int,
    methods: list[str] | None,
    budgets: list[float] | None,
    budget_scale: str,
    predictor: str,
    profile: str | None,
    seed: int,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Validate, run, print the tables and the predictor timing, write JSON and PNG."""
    from duetime.bench import timebill as sim_bench
    from duetime.bench import timebill_engine as bench
    from duetime.bench import timebill_engine_report as report
    from duetime.bench.engine_fit import check_context, engine_context

    if min_prompt > max_prompt:
        raise ValueError(f"--min-prompt {min_prompt} > --max-prompt {max_prompt}")
    if methods:  # --method a,b as every other list option reads it, or repeated
        methods = list(dict.fromkeys(m for item in methods for m in comma_list(item)))
    bad = [m for m in methods or () if m not in sim_bench.METHODS]
    if bad:
        raise ValueError(f"unknown --method {bad}; choose from {', '.join(sim_bench.METHODS)}")
    if budget_scale not in bench.BUDGET_SCALES:
        raise ValueError(f"--budget-scale must be job or step, got {budget_scale!r}")
    sim_bench.check_budgets(budgets)
    if model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    # Every prompt and its answer must fit the model's context (its config, not its weights).
    check_context(
        max_prompt + n_max, engine_context(model), f"--max-prompt {max_prompt} + --n-max {n_max}"
    )
    cost = None
    if profile is not None:
        from duetime.predict.cost_report import check_profile_engine
        from duetime.sim.profiles import load_profile

        cost, _ = load_profile(profile)
        check_profile_engine(cost.meta, profile, dtype, threads)
    m = load(model, dtype, threads)
    jobs = None
    if model == "tiny":
        jobs = bench.fold_ids(bench.workload(prompts, n_max, min_prompt, max_prompt, seed), m)
    fig = bench.run(
        m, prompts=prompts, n_max=n_max, min_prompt=min_prompt, max_prompt=max_prompt,
        seed=seed, methods=tuple(methods or sim_bench.METHODS), budgets=budgets,
        budget_scale=budget_scale, predictor=predictor, cost=cost, jobs=jobs,
    )  # fmt: skip
    fig.update({"model": model, "dtype": dtype, "threads": threads})
    w, pt = fig["workload"], fig["predictor_timing"]
    out.print(
        f"{w['jobs']} ShareGPT prompts (mean {w['prompt_tokens_mean']:.0f} tokens), outputs "
        f"<= N_max {fig['n_max_tokens']} (mean {w['output_tokens_mean']:.0f}), EOS ignored; "
        f"{model} {dtype}, {threads} threads, eviction {fig['eviction']}; decode step "
        f"{1000 * fig['decode_step_s']:.1f} ms"
    )
    for t in report.table(fig):
        out.print(t)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    out.print(
        f"predictor ({fig['predictor']}) beside prefill: t_Predict p50 {ms(pt['predict_p50_s'])} "
        f"/ p90 {ms(pt['predict_p90_s'])} ms, t_prefill p50 {ms(pt['prefill_p50_s'])} / p90 "
        f"{ms(pt['prefill_p90_s'])} ms, engine waited p90 {ms(pt['wait_p90_s'])} ms; "
        f"{pt['predict_exceeded_prefill']} of {pt['predictions']} predictions outlasted the "
        f"prefill; compressed inputs: {pt.get('compressed_calls', '-')}"
    )
    out.print(
        f"budgets {fig['budgets_s']} s ({fig['budget_scale']} scaling; step scaling would give "
        f"{fig['budgets_step_s']} s); wall {fig['wall_s']:.1f} s"
    )
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=report.plot)
