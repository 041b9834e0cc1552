"""`duetime bench sensitivity`: how each policy degrades as length predictions get worse."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.bench.options import PoliciesOpt, SeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, ProfileOpt, _progress, _user_errors, bench_app, out
from duetime.cli.paths import input_path
from duetime.comma_lists import comma_list, comma_numbers


@bench_app.command("sensitivity")
def bench_sensitivity(
    policies: PoliciesOpt = "fcfs,sjf,amax,amin,timebill",
    errors: Annotated[str, typer.Option(help="Prediction errors σ (0 = oracle).")] = (
        "0,0.1,0.25,0.5,1"
    ),
    requests: Annotated[int, typer.Option(min=1)] = 800,
    rate: Annotated[float, typer.Option(min=0.0, help="Poisson rate, req/s.")] = 20.0,
    kv_capacity: Annotated[int, typer.Option(min=64, help="KV budget in tokens.")] = 30_000,
    deadline_scale: Annotated[float, typer.Option(help="Deadline = scale x time alone.")] = 8.0,
    profile: ProfileOpt = "a100-llama2-7b",
    learned: Annotated[
        str,
        typer.Option(
            help="Also run the trained length predictor: learned[:path], or 'none'.",
            callback=input_path,
        ),
    ] = "learned",
    workload: Annotated[
        str,
        typer.Option(help="sharegpt-heldout (rows no shipped RLP trained on) or sharegpt."),
    ] = "sharegpt-heldout",
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = Path("out/bench-sensitivity.png"),
) -> None:
    """TEL and deadline hit rate of each policy vs length-prediction error (simulated)."""
    from duetime.bench import sensitivity as bench
    from duetime.metrics import render_table

    with _user_errors():
        sigmas = comma_numbers("--errors", errors, float, "numbers", allow_empty=True)
        names = comma_list(policies)
        extra = None if learned == "none" else learned
        if not names:  # ran nothing and wrote an empty table, exit 0
            raise ValueError(f"--policies names no policy: {policies!r}")
        if not sigmas and extra is None:
            raise ValueError("--errors names no σ and --learned is none: nothing to run")
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
                workload=workload,
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
    note = bench.completion_note(fig)
    if note is not None:
        out.print(f"note: {note}", markup=False, highlight=False)
    out.print(f"wall {fig['wall_s']:.1f} s")
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot)
