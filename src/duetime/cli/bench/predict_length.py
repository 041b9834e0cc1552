"""`duetime bench predict-length`: the response-length predictor against its baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, PlotOpt, _user_errors, bench_app, open_share, out
from duetime.cli.paths import input_path


@bench_app.command("predict-length")
def bench_predict_length(
    model: Annotated[
        list[Path] | None,
        typer.Option(
            help="A model file; repeat for several (default: every shipped model).",
            callback=input_path,
        ),
    ] = None,
    coverage: Annotated[
        float, typer.Option(help="Nominal interval coverage, in (0, 1).", callback=open_share)
    ] = 0.9,
    infer_prompts: Annotated[int, typer.Option(min=1, help="Prompts to time.")] = 200,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Response-length predictor vs baselines: MAE, RMSE, R², coverage, p50/p99 latency."""
    from rich.table import Table

    from duetime.bench import predict_length as bench
    from duetime.predict.length_fit import SHIPPED_MODELS, shipped_model_path

    models = model or [shipped_model_path(name) for name in SHIPPED_MODELS]
    with _user_errors():
        fig = bench.run(models, coverage=coverage, infer_prompts=infer_prompts)
    rows = [
        (Path(fig["model"]).stem, fig),
        *((Path(o["model"]).stem, o) for o in fig["other_models"]),
    ]
    for name, f in rows:
        table = Table(
            title=f"{name}: {f['encoder']}, readout {f['readout']}, {f['test_rows']} test"
        )
        for col in ("predictor", "MAE", "RMSE", "R²", "bucket acc", "cover", "width"):
            table.add_column(col, justify="left" if col == "predictor" else "right")
        for label, m in [("RLP", f), *f["baselines"].items()]:
            cov = m["coverage"]  # at the asked --coverage, for the RLP and every baseline
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
        lines = [
            f"MAE / best baseline ({f['best_baseline']}) = {f['mae_ratio_vs_best_baseline']:.3f}"
            f" (<= 0.8: {met['mae_ratio']}; 95% bootstrap interval over the test rows"
            f" {f['mae_ratio_ci95'][0]:.3f}-{f['mae_ratio_ci95'][1]:.3f})",
            f"90% interval coverage {f['coverage_90']:.3f} (>= 0.88: {met['coverage_90']})",
            f"inference ({f['infer_precision']}) p50 {f['infer_p50_ms']:.1f} ms,"
            f" p99 {f['infer_p99_ms']:.1f} ms (<= 20 ms: {met['infer_p99_ms']})",
        ]
        if coverage != 0.9:  # the table's intervals; the target is judged at 90 % whatever
            lines.insert(1, f"{coverage:.0%} interval coverage {f['coverage']:.3f}")
        out.print("\n".join(lines))
    # Keys starting with "_" hold plot-only data, not figures.
    public = {k: v for k, v in fig.items() if not k.startswith("_")}
    save_figures(fig, json_path=json_path, plot=plot, plot_fn=bench.plot, json_fig=public)
