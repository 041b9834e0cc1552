"""`duetime load`: measure any OpenAI-compatible server (ours, vLLM, llama.cpp) under load."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from duetime.cli.common import (
    ArrivalOpt,
    BurstSizeOpt,
    CvOpt,
    FixedMaxTokensOpt,
    JsonOpt,
    MaxContextOpt,
    MaxTokensOpt,
    PlotOpt,
    _progress,
    _user_errors,
    app,
    drawn_shape,
    err,
    given_options,
    out,
    refuse_drawing_options,
)
from duetime.cli.paths import input_path

if TYPE_CHECKING:  # (imported when the command runs: the CLI starts without them)
    from duetime.core.record import RequestRecord
    from duetime.server.load_workload import LoadRequest, LoadWorkload
    from duetime.server.loadgen import Bounds, Target


@app.command()
def load(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(help="Server root, e.g. http://127.0.0.1:8000.")] = (
        "http://127.0.0.1:8000"
    ),
    model: Annotated[
        str | None, typer.Option(help="Model name to ask for (default: the first /v1/models).")
    ] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Use /v1/chat/completions.")] = False,
    system_prompt: Annotated[
        str | None,
        typer.Option(
            help="Text every request begins with (chat: a system message), as agents and "
            "robots send: what a server's prefix cache serves. Not counted in --max-context."
        ),
    ] = None,
    workload: Annotated[
        str, typer.Option(help="sharegpt, synthetic, or a JSONL trace path.", callback=input_path)
    ] = "sharegpt",
    requests: Annotated[
        int, typer.Option("--max-requests", "--requests", min=1, help="Requests per rate, at most.")
    ] = 100,
    rate: Annotated[
        str,
        typer.Option(help="Arrival rate(s), requests/s ('inf': all at once); '1,2,4' sweeps."),
    ] = "1",
    arrival: ArrivalOpt = "poisson",
    cv: CvOpt = 1.0,
    burst_size: BurstSizeOpt = 1,
    seed: Annotated[
        int,
        typer.Option(min=0, help="Seed of lengths, arrivals, classes; sweep rate k uses seed + k."),
    ] = 0,
    prompt_len: Annotated[str, typer.Option(help="Synthetic prompt tokens: N or LO-HI.")] = (
        "16-512"
    ),
    output_len: Annotated[str, typer.Option(help="Synthetic output tokens: N or LO-HI.")] = (
        "16-256"
    ),
    max_tokens: MaxTokensOpt = 1024,
    max_context: MaxContextOpt = 2048,
    fixed_max_tokens: FixedMaxTokensOpt = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Ask for exactly max_tokens (vLLM, duetime).")
    ] = False,
    class_mix: Annotated[
        str | None, typer.Option(help="Request classes and weights: interactive=0.3,batch=0.7.")
    ] = None,
    deadline: Annotated[
        list[str] | None,
        typer.Option(help="CLASS=SECONDS after arrival (repeatable); SECONDS alone: every class."),
    ] = None,
    priority: Annotated[
        list[str] | None,
        typer.Option(help="Priority sent with the requests: INT for all, or CLASS=INT."),
    ] = None,
    duration: Annotated[
        float, typer.Option(min=0.0, help="Stop launching after this many seconds.")
    ] = 60.0,
    drain_timeout: Annotated[
        float,
        typer.Option(min=0.0, help="Then wait this many seconds for the requests still in flight."),
    ] = 30.0,
    request_timeout: Annotated[
        float,
        typer.Option(min=0.001, help="Give up on a request once silent for this many seconds."),
    ] = 120.0,
    concurrency: Annotated[int, typer.Option(min=1, help="Connection pool size.")] = 256,
    allow_remote: Annotated[
        bool, typer.Option("--allow-remote", help="Allow a target that is not this machine.")
    ] = False,
    api_key: Annotated[str | None, typer.Option(help="Bearer token, if the server wants one.")] = (
        None
    ),
    slo_ttft_ms: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Send llm-d's x-slo-ttft-ms with every request (a first-token bound, ms; "
            "duetime gateway refuses with 429 what it forecasts late); report the share "
            "answered within it and how fast refusals came.",
        ),
    ] = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Open-loop load against an OpenAI-compatible endpoint: TTFT, TBT, e2e, goodput, deadlines."""
    from duetime.metrics import write_json
    from duetime.server import load_workload as lw
    from duetime.server.load_target import check_target, resolve_model
    from duetime.server.loadgen import Bounds, Target

    with _user_errors():
        base = check_target(url, allow_remote=allow_remote)
        # the text options parsed in option order: a bad one fails before any request is
        # sent, naming its option
        spec = lw.LoadWorkload(
            workload=workload,
            requests=requests,
            arrival=arrival,
            cv=cv,
            burst_size=burst_size,
            seed=seed,
            max_tokens=max_tokens,
            max_context=max_context,
            fixed_max_tokens=fixed_max_tokens,
            **drawn_shape(prompt_len, output_len, class_mix, deadline),
            priorities=lw.parse_class_values(priority or [], "--priority", int),
        )
        if spec.is_trace and Path(workload).exists():  # a missing file: build names it
            refuse_drawing_options(ctx, ("rate", "arrival", "cv", "burst_size"))
        rates = _rates(spec, rate)
        if not duration > 0:  # it sent nothing and exited 0
            raise ValueError(f"--duration must be > 0 s (no request is sent in {duration:g} s)")
        bounds = Bounds(
            max_requests=requests,
            duration_s=duration,
            drain_timeout_s=drain_timeout,
            request_timeout_s=request_timeout,
            concurrency=concurrency,
        )
        plans = _plans(spec, rates)  # before any request: a bad trace line is named first
        model, context = resolve_model(base, model, api_key=api_key)
        if (
            context is not None
            and context < spec.max_context
            and not given_options(ctx, "max_context")
        ):  # the default sent requests the server could only refuse (HTTP 400)
            err.print(f"--max-context {context}: {model}'s max_model_len at {base}")
            spec = dataclasses.replace(spec, max_context=context)
            plans = _plans(spec, rates)
    target = Target(
        base=base,
        model=model,
        chat=chat,
        ignore_eos=ignore_eos,
        api_key=api_key,
        system_prompt=system_prompt,
        slo_ttft_ms=slo_ttft_ms,
    )
    slo_s = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0

    rows, records = _run_plans(plans, target, bounds, requests, slo_s)
    _print_table(rows, target, slo_s)
    with _user_errors():  # a full disk or a vanished folder: one line naming the file
        if json_path is not None:
            write_json(json_path, {"config": _config(target, spec, bounds), "rows": rows})
        if plot is not None:
            _plot(rows, records, plot)
    for path in (json_path, plot):
        if path is not None:
            out.print(f"wrote {Path(path)}")


# --- before any request: the options as a workload and its rates --------------------------
def _rates(spec: LoadWorkload, rate: str) -> list[float | None]:
    """The rates to run, one run each. A trace brings its own arrival times, so it runs
    once, at no rate (``None``)."""
    from duetime.server import load_workload as lw

    return [None] if spec.is_trace else list(lw.parse_rates(rate))


def _plans(spec: LoadWorkload, rates: list[float | None]) -> list[tuple[float | None, Any]]:
    """Each rate's requests. Each rate of a sweep draws its own (seed + its place in the
    sweep): the same prompts again would find the last run's in the server's prefix cache."""
    return [
        (r, dataclasses.replace(spec, seed=spec.seed + k).build(r if r is not None else 1.0))
        for k, r in enumerate(rates)
    ]


# --- the runs ------------------------------------------------------------------------------
def _run_plans(
    plans: list[tuple[float | None, list[LoadRequest]]],
    target: Target,
    bounds: Bounds,
    requests: int,
    slo_s: float | None,
) -> tuple[list[dict[str, Any]], dict[str, list[RequestRecord]]]:
    """Send each rate's requests in turn: a summary row per run (for the table and the JSON)
    and its requests' records by run label (for a plot of one run)."""
    from duetime.server.load_report import run_label, summarize_run, to_record
    from duetime.server.loadgen import run_load

    rows: list[dict[str, Any]] = []
    records: dict[str, list[RequestRecord]] = {}
    for r, plan in plans:
        label = run_label(r)
        prog, cb = _progress(min(len(plan), requests), f"load {label}")
        with prog:
            run = run_load(plan, target, bounds, progress=cb)
        # "run" tells "trace" from "inf/s": strict JSON writes both rates as null
        row = {"rate_req_s": r, "run": label, **summarize_run(run, slo_s)}
        rows.append(row)
        records[label] = [to_record(o) for o in run.sent]
        _print_top_error(label, row)
    return rows, records


def _print_top_error(label: str, row: dict[str, Any]) -> None:
    """Name a run's most common error as it ends: the table only counts them."""
    from rich.markup import escape

    if row["top_errors"]:
        message, count = next(iter(row["top_errors"].items()))
        # escape: the message quotes the server ("[/INST]" was a MarkupError traceback)
        err.print(escape(f"{label}: {row['errors']} errors; most common ({count}×): {message}"))


# --- the report ----------------------------------------------------------------------------
def _print_table(rows: list[dict[str, Any]], target: Target, slo_s: float | None) -> None:
    """One table row per run; deadline and TTFT-SLO columns only where the runs have them."""
    from rich.markup import escape

    from duetime.metrics import render_table
    from duetime.server.load_report import TABLE_KEYS, run_label

    keys = list(TABLE_KEYS)
    keys += sorted({k for row in rows for k in row if k.startswith("deadline_hit_rate[")})
    if slo_s is not None:
        keys += ["ttft_slo_met_rate", "ttft_slo_refused", "ttft_slo_refusal_p50_s"]
    shown = [(run_label(row["rate_req_s"]), row) for row in rows]  # render_table escapes labels
    title = escape(f"{target.model} at {target.base}{target.path}")
    out.print(render_table(shown, keys=keys, title=title))


def _config(target: Target, spec: LoadWorkload, bounds: Bounds) -> dict[str, Any]:
    """The JSON's record of what was measured and how: enough to run it again."""
    return {
        "url": target.base,
        "model": target.model,
        "endpoint": target.path,
        "ignore_eos": target.ignore_eos,
        "system_prompt_chars": len(target.system_prompt or ""),
        "slo_ttft_ms": target.slo_ttft_ms,
        "workload": spec.workload,
        # a trace's arrivals are its own: the options that draw them played no part
        **_drawn_by(spec),
        "seed": spec.seed,
        # the requests' shape: a synthetic workload's lengths, every workload's caps
        **_lengths(spec),
        "max_tokens": spec.max_tokens,
        "fixed_max_tokens": spec.fixed_max_tokens,
        "max_context_tokens": spec.max_context,
        "class_mix": spec.class_mix,
        "deadlines_s": spec.deadlines,
        "priorities": spec.priorities,
        "bounds": bounds,
    }


def _lengths(spec: LoadWorkload) -> dict[str, Any]:
    """A synthetic workload's prompt and answer lengths ([low, high] tokens); null else."""
    synthetic = spec.workload == "synthetic"
    return {
        "prompt_len_tokens": list(spec.prompt_len) if synthetic else None,
        "output_len_tokens": list(spec.output_len) if synthetic else None,
    }


def _drawn_by(spec: LoadWorkload) -> dict[str, Any]:
    """How a generated workload's arrivals were drawn; all null for a trace."""
    drawn = {"arrival": spec.arrival, "cv": spec.cv, "burst_size": spec.burst_size}
    return dict.fromkeys(drawn) if spec.is_trace else drawn


def _plot(rows: list[dict[str, Any]], records: dict[str, list[RequestRecord]], plot: Path) -> None:
    """A sweep of rates plots its metrics against the rate; a single run (or a trace)
    plots its own requests, as there is no rate axis to draw."""
    from duetime.server.load_report import plot_rates, plot_run

    numeric = [row for row in rows if row["rate_req_s"] is not None]
    if len(numeric) > 1:
        plot_rates(numeric, plot)
    else:
        plot_run(records, plot)
