"""`duetime bench engine`: the engine's prefill / decode speed against its peers."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, out
from duetime.comma_lists import comma_numbers


@bench_app.command("engine")
def bench_engine(
    quick: Annotated[bool, typer.Option(help="Small sizes: a smoke run.")] = False,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            help="Engine variant(s): fp32, fast, q8, q8-fp32rows (q8 with many-row steps in"
            " fp32 even where the CPU has native bf16), q8-fp32kv (q8 with its KV cache in"
            " fp32, not bf16), q8-oneattn (q8 with a prefill chunk's"
            " attention in one masked call), q8-unfused (q8 with its norms as plain torch ops),"
            " q8-int8rank (q8 whose greedy steps rank the vocabulary in int8, not int4),"
            " q8-pyloop (q8 with a plain decode step's layers in Python, not the C++ loop),"
            " fp32-mkl, bf16, int8. Default: fp32, fast, q8 (what serve runs), fp32-mkl."
        ),
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

    def ints(s: str | None, opt: str) -> tuple[int, ...] | None:
        # None: the default grid; sizes >= 1 and within the context: checked by bench.run
        return None if s is None else tuple(comma_numbers(opt, s, int, "integers"))

    with _user_errors():
        fig = bench.run(
            quick=quick,
            engines=tuple(engine or ("fp32", "fast", "q8", "fp32-mkl")),
            prefill_tokens=ints(prefill, "--prefill"),
            batch_sizes=ints(batch, "--batch"),
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
    out.print(f"peak RSS {fig['peak_rss_mib']:.0f} MiB, wall {fig['wall_s']:.1f} s")
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)
