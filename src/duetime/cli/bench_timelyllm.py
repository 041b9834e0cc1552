"""`duetime bench timelyllm` output and its `--engine` mode (kept out of the big bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duetime.cli.common import _user_errors, err, out


def _x(v: float | None) -> str:
    return "n/a (baseline total <= 0)" if v is None else f"{v:.2f}x"


def print_summary(fig: dict[str, Any]) -> None:
    """One line per workload: TimelyLLM's gain over vLLM and the paper's best."""
    for w, s in fig["summary"].items():
        out.print(
            f"{w}: timelyllm utility {_x(s['utility_gain_vs_fcfs_x'])} vs vllm "
            f"(best class {_x(s['utility_gain_best_class_x'])}; paper: up to 1.97x), "
            f"waiting {s['waiting_change_vs_fcfs_pct']:+.0f} % "
            f"(best class {s['waiting_change_best_class_pct']:+.0f} %; paper: -84 %)"
        )


def run_engine(
    *,
    wids: tuple[int, ...],
    requests: int,
    seed: int,
    kv_capacity: int | None,
    max_num_seqs: int | None,
    offload: bool,
    dtype: str,
    threads: int,
    json_path: Path | None,
    plot: Path | None,
    calibration: Path | None = None,
) -> None:
    """Load Gemma 3 270M, calibrate, run the five systems on scaled LRTrace tasks, report.

    ``calibration``: reuse the cost and scale of an earlier run's JSON, so two runs
    (offload on and off, say) serve the same jobs.
    """
    import torch

    from duetime.bench import timelyllm as sim_bench
    from duetime.bench import timelyllm_engine as bench
    from duetime.engine import load_model
    from duetime.engine.gemma3 import DTYPES
    from duetime.metrics import write_json

    with _user_errors():
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        calib = bench.calibration_from_json(calibration) if calibration is not None else None
        torch.set_num_threads(threads)
        model = load_model(dtype=dtype, progress=False)  # type: ignore[arg-type]
        if calib is None:
            err.print("calibrating the step cost (a few dozen timed steps)...")
        fig = bench.run(
            model,
            wids=wids,
            requests=requests,
            seed=seed,
            kv_capacity=kv_capacity or 8192,
            max_num_seqs=max_num_seqs or 16,
            offload=offload,
            calibration=calib,
            progress=lambda s: err.print(f"running {s} on the engine"),
        )
    fig["dtype"] = dtype
    fig["torch_threads"] = threads
    fig["calibration_from"] = None if calibration is None else str(calibration)
    sc = fig["scale"]
    out.print(sim_bench.table(fig))
    print_summary(fig)
    out.print(
        f"scaling: time x{sc['time_x']:.2f} (decode step {1e3 * sc['decode_step_s']:.1f} ms vs "
        f"the paper's 21.5 ms), prompts x{sc['prompt_x']:.3f}; engine wall "
        f"{sum(r['wall_s'] for r in fig['rows']):.0f} s for {len(fig['rows'])} runs"
    )
    sim = {(r["wid"], r["system"]): r for r in fig["simulated_same_jobs"]["rows"]}
    out.print(
        "simulator on the same jobs (utility total): "
        + ", ".join(
            f"WID{r['wid']} {r['system']} {sim[r['wid'], r['system']]['time_utility_total']:.1f}"
            f" (engine {r['time_utility_total']:.1f})"
            for r in fig["rows"]
        )
    )
    if plot is not None:
        sim_bench.plot(
            fig,
            plot,
            title=f"TimelyLLM vs baselines on the real engine\n(Gemma 3 270M {dtype}, "
            f"{requests} tasks, time x{sc['time_x']:.2f})",
        )
    if json_path is not None:
        write_json(json_path, fig)
