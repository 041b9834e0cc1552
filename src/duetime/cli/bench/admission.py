"""`duetime bench admission`: deadlines judged by forecast vs the estimate, under overload."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import BenchModelOpt, RepeatsOpt, SeedOpt, ServedPolicyOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import (
    BurstSizeOpt,
    DtypeOpt,
    FixedMaxTokensOpt,
    JsonOpt,
    MaxContextOpt,
    MaxTokensOpt,
    ServedPredictorOpt,
    ThreadsOpt,
    _progress,
    _user_errors,
    bench_app,
    out,
    parse_confidence,
)
from duetime.comma_lists import comma_list
from duetime.server.recent_load import DEFAULT_BURST_GAP_S


@bench_app.command("admission")
def bench_admission(
    model: BenchModelOpt = "gemma",
    dtype: DtypeOpt = "q8",
    threads: ThreadsOpt = 2,
    policy: ServedPolicyOpt = "edf",
    modes: Annotated[
        str, typer.Option(help="Admission modes to compare, comma-separated.")
    ] = "forecast,estimate",
    rate: Annotated[
        float, typer.Option(min=0.001, help="Arrivals, requests/s (Gemma q8 serves ~2).")
    ] = 3.0,
    arrival: Annotated[
        str, typer.Option(help="poisson, or bursts (--burst-size requests at Poisson times).")
    ] = "poisson",
    burst_size: BurstSizeOpt = 1,
    burst_gaps: Annotated[
        str,
        typer.Option(
            help="The server's --burst-gap-ms for the forecast arms, comma-separated: 0 "
            "(no bursts expected) and/or gaps in ms, e.g. 50,0.",
        ),
    ] = f"{DEFAULT_BURST_GAP_S * 1000:g}",
    duration: Annotated[float, typer.Option(min=1.0, help="Seconds of arrivals per run.")] = 120.0,
    deadline: Annotated[
        float, typer.Option(min=0.001, help="Every request's deadline, seconds after arrival.")
    ] = 20.0,
    max_tokens: MaxTokensOpt = 256,
    max_context: MaxContextOpt = 2048,
    fixed_max_tokens: FixedMaxTokensOpt = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos",
            help="Every answer runs to its max_tokens: the forecasts know the lengths, so "
            "their error is the step-cost model's and the unseen arrivals'.",
        ),
    ] = False,
    lengths: Annotated[
        str,
        typer.Option(
            help="The server's predicted lengths, comma-separated: served (corrected by the "
            "served model's answers, the default of `duetime serve`), predictor (as predicted)."
        ),
    ] = "served",
    confidences: Annotated[
        str,
        typer.Option(
            help="The server's --deadline-confidence for the forecast arms, comma-separated: "
            "off (the plain forecast) and/or targets in (0, 1), e.g. off,0.95."
        ),
    ] = "0.95",
    predictor: ServedPredictorOpt = "auto",
    repeats: RepeatsOpt = 1,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Overload `duetime serve` with one ShareGPT load per admission mode (fresh engine,
    modes interleaved) and compare deadline hits of the accepted requests, goodput, and
    the forecast's error (docs/server-admission.md)."""
    import torch

    from duetime.bench.admission import (
        TABLE_KEYS,
        AdmissionBenchConfig,
        arms_of,
        check_config,
        run_admission_bench,
    )
    from duetime.bench.engine_fit import check_dtype
    from duetime.metrics import render_table

    with _user_errors():
        check_dtype(dtype)  # before the model loads: bogus ran, and the JSON recorded it
        torch.set_num_threads(threads)
        cfg = AdmissionBenchConfig(
            model=model,
            dtype=dtype,
            policy=policy,
            modes=comma_list(modes),
            rate=rate,
            duration_s=duration,
            deadline_s=deadline,
            max_tokens=max_tokens,
            max_context=max_context,
            fixed_max_tokens=fixed_max_tokens,
            ignore_eos=ignore_eos,
            lengths=comma_list(lengths),
            confidences=[parse_confidence(c, "--confidences") for c in comma_list(confidences)],
            burst_gaps=[_gap_s(g) for g in comma_list(burst_gaps)],
            arrival=arrival,
            burst_size=burst_size,
            repeats=repeats,
            seed=seed,
            predictor=None if predictor == "none" else predictor,
        )
        check_config(cfg)
        prog, cb = _progress(repeats * len(arms_of(cfg)), "serving")
        with prog:
            fig = run_admission_bench(cfg, cb)
        fig.update(dtype=dtype, threads=threads, seed=seed)
    title = f"{fig['model']}, {policy}: {rate}/s for {duration:g} s, deadline {deadline:g} s"
    if fixed_max_tokens is not None:
        title += f", max_tokens {fixed_max_tokens}"
    if ignore_eos:
        title += ", ignore-EOS"
    if arrival != "poisson":
        title += f", {arrival} of {burst_size}"
    out.print(render_table(list(fig["summary"].items()), keys=TABLE_KEYS, title=title))
    for key, value in fig["ratios"].items():
        out.print(f"{key}: {value:.2f}x")
    save_figures(fig, json_path=json_path)


def _gap_s(text: str) -> float:
    try:
        return float(text) / 1000
    except ValueError:
        raise ValueError(f"--burst-gaps: {text!r} is not a number of ms") from None
