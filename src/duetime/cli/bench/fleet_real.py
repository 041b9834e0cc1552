"""`duetime bench fleet-real`: the same trace through a real fleet and the simulated one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from duetime.cli.bench.options import SeedOpt, ServedModelOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import (
    JsonOpt,
    MaxContextOpt,
    MaxTokensOpt,
    PlotOpt,
    _fail,
    _user_errors,
    bench_app,
    drawn_shape,
    out,
    progress_display,
)
from duetime.comma_lists import comma_list


@bench_app.command("fleet-real")
def bench_fleet_real(
    model: ServedModelOpt = "gemma",
    replicas: Annotated[int, typer.Option(min=1, help="`duetime serve` backends.")] = 2,
    threads_per_replica: Annotated[int, typer.Option(min=1, help="Threads of each backend.")] = 1,
    routers: Annotated[
        str, typer.Option(help="Comma-separated routers: one real and one simulated run each.")
    ] = "forecast,lor,round-robin",
    policy: Annotated[str, typer.Option(help="Every backend's (and replica's) policy.")] = "edf",
    rate: Annotated[
        float | None,
        typer.Option(help="Arrival rate, req/s (default: --load x the fleet's capacity)."),
    ] = None,
    load: Annotated[
        float, typer.Option(help="Without --rate: the share of the estimated capacity.")
    ] = 0.8,
    requests: Annotated[int, typer.Option(min=1, help="Requests in the trace.")] = 100,
    workload: Annotated[str, typer.Option(help="synthetic or sharegpt.")] = "synthetic",
    prompt_len: Annotated[
        str,
        typer.Option(help="Synthetic prompt words (a token each to Gemma): N or LO-HI."),
    ] = "128",
    output_len: Annotated[str, typer.Option(help="Synthetic answer tokens: N or LO-HI.")] = "64",
    max_tokens: MaxTokensOpt = 256,
    max_context: MaxContextOpt = 1024,
    class_mix: Annotated[
        str | None,
        typer.Option(help="Classes and weights: interactive=0.3,batch=0.7 (default: 3 classes)."),
    ] = None,
    deadline: Annotated[
        list[str] | None,
        typer.Option(
            help="CLASS=SECONDS after arrival (repeatable); default: each class's multiple "
            "of a request's time alone."
        ),
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Each backend's largest batch.")] = 8,
    max_batch_tokens: Annotated[
        int, typer.Option(min=16, help="Each backend's tokens per step.")
    ] = 256,
    start_timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds a backend may take to answer /health.")
    ] = 600.0,
    drain_timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds a real run may take after its last arrival.")
    ] = 600.0,
    external: Annotated[
        list[str] | None,
        typer.Option(
            help="URL=PROFILE.json (repeatable): a running backend this run does not start "
            "(vLLM, say) serving the same model, priced by the profile `duetime profile "
            "--url` fitted for it; it joins the fleet beside the --replicas started ones."
        ),
    ] = None,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Send one trace through `duetime gateway --router X` over real `duetime serve`
    backends and through `duetime sim --replicas N --router X` priced by each backend's
    published cost model; compare e2e request by request and the deadline hit rates."""
    from duetime.bench.fleet_real import FleetRealConfig, run_fleet_real
    from duetime.bench.fleet_real_procs import FleetStartError

    with _user_errors():
        cfg = FleetRealConfig(
            model=model,
            replicas=replicas,
            threads_per_replica=threads_per_replica,
            routers=comma_list(routers),
            policy=policy,
            rate=rate,
            load=load,
            requests=requests,
            workload=workload,
            max_tokens=max_tokens,
            max_context=max_context,
            **drawn_shape(prompt_len, output_len, class_mix, deadline),
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            seed=seed,
            start_timeout_s=start_timeout,
            drain_timeout_s=drain_timeout,
            external=_external(external or []),
        )
        cfg.check()
        try:
            with _stages() as progress:
                fig = run_fleet_real(cfg, progress)
        except FleetStartError as e:
            _fail(str(e))
    _report(fig)
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=_plot)  # it says what it wrote


def _external(items: list[str]) -> dict[str, str]:
    """``URL=PROFILE.json`` items as URL -> absolute path (the gateway runs elsewhere)."""
    from pathlib import Path

    out: dict[str, str] = {}
    for item in items:
        url, sep, path = item.partition("=")
        url = url.rstrip("/")
        if not sep or not url.startswith(("http://", "https://")) or not path:
            raise ValueError(f"--external {item!r} must be URL=PROFILE.json (http://HOST:PORT)")
        if url in out:
            raise ValueError(f"--external {url} is given twice")
        out[url] = str(Path(path).resolve())
    return out


@contextmanager
def _stages() -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress display with one bar per stage (backends, warm-up, each run),
    kept on screen: how long each stage took is worth seeing afterwards."""
    prog = progress_display(transient=False)
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = prog.add_task(stage, total=total)
        prog.update(tasks[stage], completed=done, total=total)

    with prog:
        yield update


def _report(fig: dict[str, Any]) -> None:
    from rich.markup import escape

    from duetime.bench.fleet_real_compare import (
        COMPARISON,
        FIGURES,
        comparison_columns,
        run_columns,
    )
    from duetime.metrics import render_table

    how = (
        f"{fig['load']:.0%} of the fleet's capacity, {fig['capacity_req_s']:.3g} req/s, "
        "estimated from the backends' published profiles"
        if fig["rate_chosen"]
        else "given"
    )
    out.print(f"rate: {fig['rate_req_s']:.3g} req/s ({how})")
    deadlines = ", ".join(f"{k} {v:g} s" for k, v in fig["deadlines_s"].items())
    mix = ", ".join(f"{k} {v:.0%}" for k, v in fig["class_mix"].items())
    out.print(escape(f"deadlines: {deadlines}" + (f" (mix: {mix})" if mix else "")))
    for run in fig["runs"]:
        cols = run_columns(run)
        keys = list(dict.fromkeys([*FIGURES, *(k for _, c in cols for k in c)]))
        title = f"router {run['router']}: {fig['replicas']} x {fig['model']}"
        out.print(render_table(cols, keys=keys, title=escape(title)))
    for which, profiles in (("compare", "fitted to each run"), ("compare_warmup", "warm-up")):
        title = f"sim against real (profiles: {profiles})"
        out.print(render_table(comparison_columns(fig, which), keys=list(COMPARISON), title=title))


def _plot(fig: dict[str, Any], path: Any) -> object:
    from duetime.bench.fleet_real_compare import plot_fleet_real

    return plot_fleet_real(fig, path)
