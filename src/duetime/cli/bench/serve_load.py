"""`duetime bench serve-load`: a loaded `duetime serve` beside its own engine, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.bench.options import ServedModelOpt, ServedPolicyOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, ThreadsOpt, _progress, _user_errors, bench_app, out
from duetime.comma_lists import comma_numbers
from duetime.server.autosize import DEFAULT_TPOT_TARGET_MS


@bench_app.command("serve-load")
def bench_serve_load(
    model: ServedModelOpt = "gemma",
    dtype: Annotated[str, typer.Option(help="The served dtype (duetime serve's default).")] = "q8",
    threads: ThreadsOpt = 2,
    policy: ServedPolicyOpt = "edf",
    rates: Annotated[str, typer.Option(help="Arrival rates, req/s; inf: all at once.")] = (
        "1,4,inf"
    ),
    requests: Annotated[
        str, typer.Option(help="Requests per rate: one number, or one per rate.")
    ] = "60,80,100",
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt tokens (synthetic).")] = 256,
    output_len: Annotated[int, typer.Option(min=1, help="Answer tokens (ignore-EOS).")] = 128,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(min=1, help="Largest running batch (default: auto, as duetime serve)."),
    ] = None,
    max_batch_tokens: Annotated[
        int | None,
        typer.Option(min=16, help="Tokens per step (default: auto, as duetime serve)."),
    ] = None,
    tpot_target_ms: Annotated[
        float, typer.Option(min=1.0, help="The decode step auto sizes for (duetime serve's).")
    ] = DEFAULT_TPOT_TARGET_MS,
    offline: Annotated[
        bool, typer.Option(help="Replay each rate's requests through the engine offline too.")
    ] = True,
    seed: Annotated[int, typer.Option(min=0, help="Load seed (prompts, arrivals).")] = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """A loaded server's steps beside the offline engine's at the same batch, part by part."""
    from duetime.bench.engine_fit import check_dtype
    from duetime.bench.serve_load import ServeLoadConfig, run_serve_load
    from duetime.bench.serve_load_report import band_rows, rate_rows
    from duetime.metrics import render_table
    from duetime.server.load_workload import parse_rates

    with _user_errors():
        check_dtype(dtype)  # before the server starts: bogus ran, and the JSON recorded it
        counts = comma_numbers("--requests", requests, int, "integers")
        cfg = ServeLoadConfig(
            model=model,
            dtype=dtype,
            threads=threads,
            policy=policy,
            rates=parse_rates(rates),
            requests=counts,
            prompt_len=prompt_len,
            output_len=output_len,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            tpot_target_ms=tpot_target_ms,
            offline=offline,
            seed=seed,
        )
        cfg.check()
        prog, cb = _progress(len(cfg.rates) * (2 if offline else 1), "serve-load")
        with prog:
            fig = run_serve_load(cfg, cb)
    title = (
        f"{fig['model']} {fig['dtype']}, {fig['threads']} threads, {fig['policy']}, "
        f"max_num_seqs {fig['max_num_seqs']}, max_batch_tokens {fig['max_batch_tokens']} "
        f"({fig['limits']['source']}): {prompt_len} in / {output_len} out"
    )
    by_rate = rate_rows(fig)
    keys = list(dict.fromkeys(k for _, row in by_rate for k in row))
    out.print(render_table(by_rate, keys=keys, title=title))
    for label, rows in band_rows(fig):
        if rows:
            keys = list(rows[0][1])
            out.print(render_table(rows, keys=keys, title=f"{label}: decode-only steps by batch"))
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=_plot)


def _plot(fig: dict, path: Path) -> object:
    from duetime.bench.serve_load_report import plot_serve_load

    return plot_serve_load(fig, path)
