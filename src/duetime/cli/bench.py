"""Benchmark commands (`duetime bench ...`): speed and reproduced results."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.common import (
    JsonOpt,
    PlotOpt,
    _progress,
    _user_errors,
    bench_app,
    out,
)

EngineModelOpt = Annotated[
    str | None, typer.Option(help="--engine: gemma (default), tiny or a GGUF path.")
]
EngineDtypeOpt = Annotated[
    str | None, typer.Option(help="--engine: fp32 (default), fast, q8, bf16 or int8.")
]
EngineThreadsOpt = Annotated[
    int | None, typer.Option(min=1, help="--engine: torch threads [1: a shared 2-core machine].")
]
EngineClockOpt = Annotated[
    str | None,
    typer.Option(
        help="--engine: time the engine in cpu seconds of this process (1 thread) or wall [cpu]."
    ),
]


def _no_engine_options(given: Mapping[str, object]) -> None:
    """Engine-only options without ``--engine`` are a mistake, not something to ignore."""
    from duetime.cli.common import _fail

    bad = [name for name, v in given.items() if v is not None]
    if bad:
        _fail(f"{', '.join(bad)} only apply with --engine")


@bench_app.command("sim")
def bench_sim(
    requests: Annotated[int, typer.Option(min=1)] = 100_000,
    seed: Annotated[int, typer.Option()] = 0,
    target_running: Annotated[float, typer.Option(help="Sequences to keep running.")] = 128.0,
    json_path: JsonOpt = None,
) -> None:
    """Simulator speed at 100k ShareGPT requests (target: <= 10 s wall)."""
    from duetime.bench import sim_speed
    from duetime.metrics import write_json

    with _user_errors():
        fig = sim_speed.run(requests=requests, seed=seed, target_running=target_running)
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
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("engine")
def bench_engine(
    quick: Annotated[bool, typer.Option(help="Small sizes: a smoke run.")] = False,
    engine: Annotated[
        list[str] | None, typer.Option(help="Engine variant(s): fp32, fast, fp32-mkl, bf16, int8.")
    ] = None,
    transformers: Annotated[
        str, typer.Option(help="transformers dtypes to compare, comma-separated ('' = none).")
    ] = "fp32,bf16",
    prefill: Annotated[str | None, typer.Option(help="Prompt lengths, e.g. 128,512,2048.")] = None,
    batch: Annotated[str | None, typer.Option(help="Decode batch sizes, e.g. 1,4,16,64.")] = None,
    context: Annotated[int | None, typer.Option(min=1, help="Prompt tokens before decode.")] = None,
    reps: Annotated[int, typer.Option(min=1, help="Interleaved repetitions per cell.")] = 3,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads.")] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Engine prefill / decode tok/s and peak RSS vs transformers (and llama.cpp if installed)."""
    from duetime.bench import engine_speed as bench
    from duetime.metrics import write_json

    def ints(s: str | None) -> tuple[int, ...] | None:
        return tuple(int(x) for x in s.split(",") if x) if s else None

    with _user_errors():
        fig = bench.run(
            quick=quick,
            engines=tuple(engine or ("fp32", "fast", "fp32-mkl")),
            prefill_tokens=ints(prefill),
            batch_sizes=ints(batch),
            context=context,
            reps=reps,
            transformers=tuple(x for x in transformers.split(",") if x),
            threads=threads,
        )
    out.print(bench.table(fig))
    for name, r in fig["ratios"].items():
        for peer, cells in r.items():
            out.print(f"{name} {peer}: " + ", ".join(f"{k} {v:.2f}x" for k, v in cells.items()))
    for name, a in fig["agreement"].items():
        out.print(f"{name}: top-1 = fp32 at {a['top1_agreement_vs_fp32']:.1%} of {a['positions']}")
    for note in fig["notes"]:
        out.print(note)
    out.print(f"peak RSS {fig['peak_rss_mb']:.0f} MB, wall {fig['wall_s']:.1f} s")
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("predict-length")
def bench_predict_length(
    model: Annotated[
        list[Path] | None, typer.Option(help="Model file(s); default: both shipped models.")
    ] = None,
    coverage: Annotated[float, typer.Option(help="Nominal interval coverage.")] = 0.9,
    infer_prompts: Annotated[int, typer.Option(min=1, help="Prompts to time.")] = 200,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Response-length predictor vs baselines: MAE, RMSE, R², coverage, p50/p99 latency."""
    from duetime.bench import predict_length as bench
    from duetime.metrics import write_json
    from duetime.predict.length_fit import SHIPPED_MODELS, shipped_model_path

    models = model or [shipped_model_path(name) for name in SHIPPED_MODELS]
    with _user_errors():
        fig = bench.run(models, coverage=coverage, infer_prompts=infer_prompts)
    rows = [
        (Path(fig["model"]).stem, fig),
        *((Path(o["model"]).stem, o) for o in fig["other_models"]),
    ]
    from rich.table import Table

    for name, f in rows:
        table = Table(
            title=f"{name}: {f['encoder']}, readout {f['readout']}, {f['test_rows']} test"
        )
        for col in ("predictor", "MAE", "RMSE", "R²", "bucket acc", "cover", "width"):
            table.add_column(col, justify="left" if col == "predictor" else "right")
        for label, m in [("RLP", f), *f["baselines"].items()]:
            cov = m.get("coverage_90", m.get("coverage", float("nan")))
            table.add_row(
                label,
                f"{m['mae_tokens']:.1f}",
                f"{m['rmse_tokens']:.1f}",
                f"{m['r2']:.3f}",
                f"{m['bucket_acc']:.3f}",
                f"{cov:.3f}",
                f"{m['interval_width_tokens']:.0f}",
            )
        out.print(table)
        met = {k: "met" if v else "NOT met" for k, v in f["targets_met"].items()}
        out.print(
            f"MAE / best baseline ({f['best_baseline']}) = {f['mae_ratio_vs_best_baseline']:.3f}"
            f" (<= 0.8: {met['mae_ratio']})\n"
            f"{coverage:.0%} interval coverage {f['coverage_90']:.3f}"
            f" (>= 0.88: {met['coverage_90']})"
            f"\ninference p50 {f['infer_p50_ms']:.1f} ms, p99 {f['infer_p99_ms']:.1f} ms"
            f" (<= 20 ms: {met['infer_p99_ms']})"
        )
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, {k: v for k, v in fig.items() if not k.startswith("_")})


@bench_app.command("amin")
def bench_amin(
    requests: Annotated[
        int | None, typer.Option(min=1, help="ShareGPT requests [2000; --engine: 12].")
    ] = None,
    kv_capacity: Annotated[
        int | None, typer.Option(min=1, help="KV memory M, tokens [111000; --engine: 224].")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Step-cost profile [a100-llama2-7b]; --engine: this engine's (timed if not given)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Parallel workers.")] = 2,
    two_point: Annotated[
        bool, typer.Option(help="Also check A_ℓ and Amin on two-point lengths.")
    ] = True,
    engine: Annotated[
        bool, typer.Option("--engine", help="Run H-SF/Amax/Amin on the real engine instead.")
    ] = False,
    model: EngineModelOpt = None,
    dtype: EngineDtypeOpt = None,
    threads: EngineThreadsOpt = None,
    clock: EngineClockOpt = None,
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
    from duetime.metrics import write_json

    engine_only = {"--model": model, "--dtype": dtype, "--threads": threads, "--clock": clock,
                   "--max-prompt": max_prompt, "--max-output": max_output,
                   "--intervals": intervals, "--reps": engine_reps}  # fmt: skip
    if engine:
        from duetime.cli import bench_engine_modes as modes

        with _user_errors():
            fig = modes.amin(
                model=model or "gemma", dtype=dtype or "fp32", threads=threads or 1,
                requests=requests or 12, kv_capacity=kv_capacity or 224,
                max_prompt=max_prompt or 256, max_output=max_output or 48,
                intervals=intervals or "overlap-0.95", profile=profile, seed=seed, plot=plot,
                clock=clock or "cpu", reps=engine_reps or 1,
            )  # fmt: skip
        if json_path is not None:
            write_json(json_path, fig)
        return
    _no_engine_options(engine_only)
    profile = profile or "a100-llama2-7b"
    with _user_errors():
        fig = bench.run(requests or 2000, seed, kv_capacity or 111_000, profile, workers, two_point)
    w = fig["workload"]
    out.print(
        f"{w['requests']:,} ShareGPT requests at t = 0 (prompt mean {w['prompt_tokens_mean']:.0f}, "
        f"output mean {w['output_tokens_mean']:.0f} tokens, <= 1,000); the paper used "
        f"LMSYS-Chat-1M; unit = 1 step per time unit, linear = profile {profile}"
    )
    out.print(bench.table(fig))
    if fig["two_point"]:
        out.print(bench.two_point_table(fig))
    out.print(f"wall {fig['wall_s']:.1f} s")
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("deferred-prefill")
def bench_deferred_prefill(
    requests: Annotated[
        int | None, typer.Option(min=1, help="Requests per run [2000; --engine: 80].")
    ] = None,
    capacity: Annotated[
        int | None, typer.Option(min=1, help="Batch capacity C [256; --engine: 16].")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Shipped profile name or JSON path [a100-llama2-7b]; --engine: this engine's "
            "(timed if not given)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Parallel workers.")] = 2,
    engine: Annotated[
        bool,
        typer.Option("--engine", help="Analytic, simulated and real curves for the real engine."),
    ] = False,
    model: EngineModelOpt = None,
    dtype: EngineDtypeOpt = None,
    threads: EngineThreadsOpt = None,
    clock: EngineClockOpt = None,
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
    from duetime.metrics import write_json

    engine_only = {"--model": model, "--dtype": dtype, "--threads": threads, "--clock": clock,
                   "--ks": ks, "--prompt-len": prompt_len, "--reps": reps,
                   "--mean-output": mean_output}  # fmt: skip
    if engine:
        from duetime.cli import bench_engine_modes as modes

        with _user_errors():
            fig = modes.deferred_prefill(
                model=model or "gemma", dtype=dtype or "fp32", threads=threads or 1,
                capacity=capacity or 16, prompt_len=prompt_len or 16,
                mean_output=mean_output or 9.0, requests=requests or 80, ks=ks,
                profile=profile, seed=seed, clock=clock or "cpu", reps=reps or 1,
            )  # fmt: skip
        if plot is not None:
            bench.plot(fig, plot)
        if json_path is not None:
            write_json(json_path, fig)
        return
    _no_engine_options(engine_only)
    profile = profile or "a100-llama2-7b"
    with _user_errors():
        fig = bench.run(requests or 2000, capacity or 256, profile, seed, workers)
    out.print(bench.table(fig))
    adv = fig["advice"]
    out.print(
        f"analytic K* = {adv['k_star']} (approximation: {adv['k_star_approx']}), "
        f"ρ(K*) = {adv['throughput_k_star_req_s']:.3f} req/s, "
        f"{adv['gain_vs_k1_pct']:+.1f} % vs K = 1"
    )
    for curve, s in fig["summary"].items():
        out.print(
            f"{curve}: best K = {s['k_best']}, {s['gain_best_vs_k1_pct']:+.1f} % throughput and "
            f"{s['completion_change_best_vs_k1_pct']:+.1f} % completion time vs K = 1; "
            f"analytic ρ(K*) {s['analytic_k_star_throughput_vs_best_pct']:+.1f} % of the best; "
            f"max |error| vs Theorem 1 {s['max_abs_error_vs_theorem1_pct']:.1f} %"
        )
    out.print(f"real engine: not run (--engine adds it); wall {fig['wall_s']:.1f} s")
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("timelyllm")
def bench_timelyllm(
    wid: Annotated[list[int] | None, typer.Option(help="LRTrace workload(s), 1-3.")] = None,
    profile: Annotated[
        str, typer.Option(help="'paper-rtx4090' (modelled on the paper) or a shipped profile.")
    ] = "paper-rtx4090",
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
    requests: Annotated[int, typer.Option(min=2, help="--engine: tasks per workload.")] = 16,
    dtype: Annotated[str, typer.Option(help="--engine: model dtype (see `duetime run`).")] = (
        "fast"
    ),
    threads: Annotated[
        int, typer.Option(min=1, help="--engine: torch threads (1 on a shared 2-core machine).")
    ] = 1,
    calibration: Annotated[
        Path | None,
        typer.Option(help="--engine: reuse an earlier --engine JSON's cost and scale (same jobs)."),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """TimelyLLM vs vLLM, vLLM-stream, segmented FCFS/EDF on LRTrace WID1-3.

    Simulated at full scale by default; `--engine` runs a few tasks on the real
    engine (default WID2, 16 tasks), time-scaled to its speed.
    """
    from duetime.bench import timelyllm as bench
    from duetime.cli.bench_timelyllm import print_summary, run_engine
    from duetime.metrics import write_json

    wids = tuple(wid or ((2,) if engine else (1, 2, 3)))
    if any(w not in (1, 2, 3) for w in wids):
        raise typer.BadParameter("--wid must be 1, 2 or 3")
    if engine:
        run_engine(
            wids=wids,
            requests=requests,
            seed=seed,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            offload=offload,
            dtype=dtype,
            threads=threads,
            json_path=json_path,
            plot=plot,
            calibration=calibration,
        )
        return
    with _user_errors():
        fig = bench.run(wids, seed, profile, kv_capacity, max_num_seqs, offload)
    out.print(bench.table(fig))
    print_summary(fig)
    oh = fig["overhead"]
    out.print(
        "scheduling overhead: "
        + ", ".join(f"{k.split('_')[-1]} tasks {v:.3f} ms" for k, v in oh.items())
        + " (paper: 2.03 ms for 8)"
    )
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("timebill")
def bench_timebill(
    jobs: Annotated[
        int | None, typer.Option(min=1, help="Periodic jobs per run (simulator) [200].")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Shipped profile name or JSON path [a100-llama2-7b]; with --engine a "
            "`duetime profile` JSON [default: time this workload's steps]."
        ),
    ] = None,
    predictor: Annotated[
        str | None,
        typer.Option(
            help="Length predictor: noisy[:σ], oracle, learned[:path] [noisy; --engine: learned]."
        ),
    ] = None,
    tasks: Annotated[int, typer.Option(min=1, help="Concurrent periodic tasks.")] = 1,
    budget: Annotated[
        list[float] | None, typer.Option(help="Time budget(s) T in s; default: paper's, scaled.")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine", help="On the real engine (small scale, minutes), with F1 / ROUGE-L scores."
        ),
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="--engine: gemma (default) or tiny (random weights).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="--engine: fp32, fast (default), bf16 or int8.")
    ] = None,
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
        list[str] | None, typer.Option(help="--engine: method(s) to run [all seven].")
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
    from duetime.cli.common import _fail
    from duetime.metrics import write_json

    engine_only = {
        "--model": model, "--dtype": dtype, "--threads": threads, "--prompts": prompts,
        "--n-max": n_max, "--min-prompt": min_prompt, "--max-prompt": max_prompt,
        "--method": method, "--budget-scale": budget_scale,
    }  # fmt: skip
    if engine:
        from duetime.cli.timebill_engine import run_cli

        if jobs is not None:
            _fail("--jobs is for the simulator; with --engine use --prompts")
        if tasks != 1:
            _fail("--engine runs one periodic task; drop --tasks")
        with _user_errors():
            run_cli(
                model=model or "gemma", dtype=dtype or "fast", threads=threads or 2,
                prompts=prompts or 6, n_max=n_max or 32, min_prompt=min_prompt or 256,
                max_prompt=max_prompt or 512, methods=method, budgets=budget,
                budget_scale=budget_scale or "job", predictor=predictor or "learned",
                profile=profile, seed=seed, json_path=json_path, plot=plot,
            )  # fmt: skip
        return
    given = [name for name, v in engine_only.items() if v is not None]
    if given:
        _fail(f"{', '.join(given)} only apply with --engine")
    with _user_errors():
        fig = bench.run(
            jobs or 200, seed, profile or "a100-llama2-7b", predictor or "noisy", tasks,
            tuple(budget or ()),
        )  # fmt: skip
    w = fig["workload"]
    out.print(
        f"{w['jobs']} ShareGPT jobs with prompts >= {bench.MIN_PROMPT} tokens "
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
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("ala")
def bench_ala(
    config: Annotated[list[str] | None, typer.Option(help="Config(s); default: all.")] = None,
    data: Annotated[
        list[Path] | None, typer.Option(help="Throughput CSV(s); default: the shipped ones.")
    ] = None,
    sa_iters: Annotated[int, typer.Option(min=1, help="Simulated-annealing iterations.")] = 25,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """ALA throughput model vs regression baselines on held-out (ii, oo) pairs; Table I."""
    from duetime.bench import ala as bench
    from duetime.cli.common import _progress
    from duetime.metrics import write_json

    with _user_errors():
        prog, cb = _progress(1, "configs")
        with prog:
            fig = bench.run(data, config, seed=seed, sa_iters=sa_iters, progress=cb)
    for t in bench.tables(fig):
        out.print(t)
    for line in bench.sa_lines(fig):
        out.print(line, highlight=False)
    out.print(f"(x: candidate rejected); wall {fig['wall_s']:.1f} s")
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, bench.public(fig))


@bench_app.command("serve")
def bench_serve(
    model: Annotated[str, typer.Option(help="gemma (real) or tiny (random, seconds).")] = "gemma",
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] = (
        "fcfs,edf,timebill,timelyllm"
    ),
    requests: Annotated[int, typer.Option(min=1, help="Requests per policy.")] = 24,
    rate: Annotated[float, typer.Option(min=0.0, help="Poisson arrival rate, req/s.")] = 0.5,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens (ignore-EOS).")] = 32,
    deadline: Annotated[
        list[str] | None, typer.Option(help="Per-class deadline CLASS=SECONDS (repeatable).")
    ] = None,
    class_mix: Annotated[str | None, typer.Option(help="CLASS=weight,... mix.")] = (
        "interactive=0.5,batch=0.5"
    ),
    overhead_requests: Annotated[
        int, typer.Option(min=10, help="Sequential no-op requests.")
    ] = 200,
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
) -> None:
    """Policies side by side behind `duetime serve` (same load), plus the server's own overhead."""
    from duetime.bench.serve import ServeBenchConfig, run_serve_bench
    from duetime.metrics import render_table, write_json
    from duetime.server.load_workload import parse_deadlines, parse_mix

    with _user_errors():
        cfg = ServeBenchConfig(
            model=model,
            policies=[p.strip() for p in policies.split(",") if p.strip()],
            requests=requests,
            rate=rate,
            max_tokens=max_tokens,
            deadlines=parse_deadlines(deadline or ["interactive=6", "batch=60"]),
            class_mix=parse_mix(class_mix),
            seed=seed,
            overhead_requests=overhead_requests,
        )
        prog, cb = _progress(len(cfg.policies) + 1, "serving")
        with prog:
            fig = run_serve_bench(cfg, cb)
    keys = [
        "ok",
        "rejected",
        "errors",
        "deadline_hit_rate",
        "goodput_req_s",
        "throughput_tok_s",
        "ttft_p50_s",
        "e2e_p50_s",
        "e2e_p90_s",
    ]
    rows = [(r["policy"], r) for r in fig["policies"]]
    out.print(
        render_table(rows, keys=keys, title=f"{fig['model']}: {requests} requests at {rate}/s")
    )
    o = fig["overhead"]
    out.print(
        f"server overhead (no-op model): added latency p50 {o['added_latency_p50_ms']:.2f} ms, "
        f"p90 {o['added_latency_p90_ms']:.2f} ms (target p50 <= 2 ms); "
        f"{o['noop_req_s']:.0f} req/s with 16 closed-loop clients, 8 tokens each"
    )
    if json_path is not None:
        write_json(json_path, fig)


@bench_app.command("sensitivity")
def bench_sensitivity(
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] = (
        "fcfs,sjf,amax,amin,timebill"
    ),
    errors: Annotated[str, typer.Option(help="Prediction errors σ (0 = oracle).")] = (
        "0,0.1,0.25,0.5,1"
    ),
    requests: Annotated[int, typer.Option(min=1)] = 800,
    rate: Annotated[float, typer.Option(min=0.0, help="Poisson rate, req/s.")] = 20.0,
    kv_capacity: Annotated[int, typer.Option(min=64, help="KV budget in tokens.")] = 30_000,
    deadline_scale: Annotated[float, typer.Option(help="Deadline = scale x time alone.")] = 8.0,
    profile: Annotated[str, typer.Option(help="Shipped profile name or JSON path.")] = (
        "a100-llama2-7b"
    ),
    learned: Annotated[
        str,
        typer.Option(help="Also run the trained length predictor: learned[:path], or 'none'."),
    ] = "learned",
    seed: Annotated[int, typer.Option()] = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = Path("out/bench-sensitivity.png"),
) -> None:
    """TEL and deadline hit rate of each policy vs length-prediction error (simulated)."""
    from duetime.bench import sensitivity as bench
    from duetime.metrics import render_table, write_json

    with _user_errors():
        try:
            sigmas = [float(x) for x in errors.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--errors must be comma-separated numbers, got {errors!r}") from None
        names = [p.strip() for p in policies.split(",") if p.strip()]
        extra = None if learned == "none" else learned
        if extra is not None and not (extra == "learned" or extra.startswith("learned:")):
            raise ValueError(f"--learned must be learned, learned:PATH or none, got {learned!r}")
        prog, cb = _progress(len(names) * (len(sigmas) + (extra is not None)), "simulating")
        with prog:
            fig = bench.run(
                names,
                sigmas,
                requests=requests,
                rate=rate,
                kv_capacity=kv_capacity,
                deadline_scale=deadline_scale,
                seed=seed,
                profile=profile,
                learned=extra,
                progress=cb,
            )
    learned_sigma = fig["learned_effective_sigma"]
    for key in ("tel_s", "deadline_hit_rate", "completion_rate"):
        cols = [
            (
                f"σ={s:g}",
                {
                    r["policy"]: r[key]
                    for r in fig["rows"]
                    if r["prediction_error_sigma"] == s and r["predictor"] != "learned"
                },
            )
            for s in fig["errors_sigma"]
        ]
        if learned_sigma is not None:
            learned_rows = [r for r in fig["rows"] if r["predictor"] == "learned"]
            cols.append(
                (f"learned σ≈{learned_sigma:.2f}", {r["policy"]: r[key] for r in learned_rows})
            )
        out.print(render_table(cols, keys=names, title=key))
    out.print(f"wall {fig['wall_s']:.1f} s")
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)
