"""`duetime profile` on the embedded engine: time its steps, fit, write and report.

The command in :mod:`duetime.cli.engine` hands over here (as ``--url`` hands over to
:mod:`duetime.cli.profile_url`). The noise floor is timed at both ends of the run:
the machine's speed drifts within one profile, and the drift is reported beside it.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from duetime.cli.common import _progress, pct_text
from duetime.cli.common import out as console

if TYPE_CHECKING:  # (the engine imports torch: not before a profile runs)
    from duetime.engine.profile import NoiseShape
    from duetime.predict.ete import StepSample


class EngineLimits(TypedDict):
    """The engine limits a profile records (`duetime profile`'s --kv-capacity,
    --max-num-seqs and --max-batch-tokens), named as ``profile_payload`` takes them."""

    kv_capacity_tokens: int
    max_num_seqs: int
    max_batch_tokens: int


@dataclass(slots=True)
class Measured:
    """What one profile run timed, in the order it timed it."""

    samples: list[StepSample]  # the grid's steps, then the serving run's
    grid_steps: int
    noise_first: list[NoiseShape]  # identical steps repeated before the grid
    noise_last: list[NoiseShape]  # and after the evictions
    evictions: list[tuple[int, float]]  # (KV tokens held, seconds)
    seconds: float

    @property
    def serving_steps(self) -> int:
        return len(self.samples) - self.grid_steps


def profile_engine(
    *,
    dtype: str,
    threads: int,
    quick: bool,
    serve_requests: int,
    out: Path,
    json_path: Path | None,
    samples_path: Path | None,
    plot: Path | None,
    limits: EngineLimits,
) -> None:
    """Load the packaged model at ``dtype``, time it, fit both cost forms, write the
    profile to ``out`` (and the steps, plot and JSON report where asked) and print the
    held-out errors beside the noise floor."""
    import torch

    from duetime.core.cost import LinearStepCost
    from duetime.engine import load_model
    from duetime.engine.cost_regimes import regimes_of
    from duetime.engine.gemma3 import DTYPES
    from duetime.engine.profile import noise_drift_pct, noise_floor_pct, pool_noise
    from duetime.engine.step_samples import write_steps
    from duetime.metrics import write_json
    from duetime.predict.cost_report import engine_of, profile_payload, repeat_floor_pct

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = load_model(dtype=dtype)  # type: ignore[arg-type]
    load_s = time.perf_counter() - t0
    run = measure(model, quick=quick, serve_requests=serve_requests)
    noise = pool_noise(run.noise_first, run.noise_last)
    name = f"gemma3-270m-cpu-{dtype}-t{threads}"
    source = (
        f"measured by `duetime profile` on {platform.node()} ({platform.machine()}, "
        f"{threads} torch threads, {dtype}) at "
        f"{datetime.now(UTC).isoformat(timespec='seconds')}: {len(run.samples)} timed steps "
        f"({run.grid_steps} of the grid, {run.serving_steps} of a serving run)"
    )
    payload = profile_payload(
        run.samples,
        name=name,
        source=source,
        **limits,
        regimes=regimes_of(model),
        noise_floor_pct=noise_floor_pct(noise),
        noise=[dataclasses.asdict(n) for n in noise],
        noise_drift_pct=noise_drift_pct(run.noise_first, run.noise_last),
        repeat_floor=repeat_floor_pct(run.samples[run.grid_steps :])[0],
        evictions=run.evictions,
        engine=engine_of(dtype, threads),
    )
    write_json(out, payload)
    if samples_path is not None:
        write_steps(
            samples_path, run.samples, ["grid"] * run.grid_steps + ["serving"] * run.serving_steps
        )
    if plot is not None:
        from duetime.predict.cost_plot import plot_step_fit

        plot_step_fit(
            LinearStepCost.from_dict(payload, str(out)), run.samples, plot,
            floor_pct=payload["verdict_floor_pct"],  # type: ignore[arg-type]
            title=f"{name}: every timed step, the fit of all",
        )  # fmt: skip
    report = report_of(payload, run, out=out, load_s=load_s)
    _print(report, payload)
    if json_path is not None:
        write_json(json_path, report)
    written = [str(p) for p in (out, samples_path, plot, json_path) if p is not None]
    console.print(f"wrote {', '.join(written)}")


def measure(model: Any, *, quick: bool, serve_requests: int) -> Measured:
    """The noise floor, the grid, ``serve_requests`` ShareGPT requests served (at most
    4 with ``quick``), the evictions and the noise floor again, with the screen told
    what runs."""
    from duetime.engine.profile import (
        ProfileGrid,
        measure_evictions,
        measure_noise,
        measure_steps,
        serving_steps,
    )

    grid = ProfileGrid.quick() if quick else ProfileGrid()
    noise_reps = 4 if quick else 15
    t0 = time.perf_counter()
    with console.status("repeating identical steps for the noise floor (start)"):
        noise_first = measure_noise(model, reps=noise_reps)
    prog, cb = _progress(1, "profiling")
    with prog:
        samples = measure_steps(model, grid, progress=cb)
    grid_steps = len(samples)
    if serve_requests:
        # --quick serves at most 4 short requests: say how many really run.
        n_serve = min(serve_requests, 4) if quick else serve_requests
        note = f" (--quick: {serve_requests} asked)" if n_serve != serve_requests else ""
        with console.status(f"serving {n_serve} ShareGPT requests{note} for in-situ steps"):
            samples += serving_steps(
                model,
                requests=n_serve,
                max_prompt=32 if quick else 256,
                max_output=8 if quick else 64,
            )
    evictions = measure_evictions(model, (32, 64) if quick else (128, 256, 512))
    with console.status("repeating identical steps for the noise floor (end)"):
        noise_last = measure_noise(model, reps=noise_reps)
    return Measured(
        samples, grid_steps, noise_first, noise_last, evictions, time.perf_counter() - t0
    )


def report_of(
    payload: dict[str, Any], run: Measured, *, out: Path, load_s: float
) -> dict[str, Any]:
    """`duetime profile --json`'s report: the run's sizes, the held-out errors and the
    floors they are judged against, and the evictions' cost."""
    held = payload["heldout"]
    cost_e = payload["coefficients"]["e"]  # fitted from the timed evictions
    return {
        "profile": str(out),
        "load_s": load_s,
        "measure_s": run.seconds,
        "samples": len(run.samples),
        "grid_samples": run.grid_steps,
        "serving_samples": run.serving_steps,
        "batch_model_mape_pct": held["batch_model_mape_pct"],
        "model_prefill_mape_pct": held["model_prefill_mape_pct"],
        "model_decode_mape_pct": held["model_decode_mape_pct"],
        "model_mixed_mape_pct": held["model_mixed_mape_pct"],
        "ete_prefill_mape_pct": held["ete_prefill_mape_pct"],
        "ete_decode_mape_pct": held["ete_decode_mape_pct"],
        "noise_floor_pct": payload["noise_floor_pct"],
        "noise_drift_pct": payload["noise_drift_pct"],
        "repeat_floor_pct": payload["repeat_floor_pct"],
        "verdict_floor_pct": payload["verdict_floor_pct"],
        "noise": payload["noise"],
        "verdict": payload["verdict"],
        "at_noise_limit": payload["at_noise_limit"],
        "regimes": payload.get("regimes"),
        "attention": payload.get("attention"),
        "misses": payload["misses"],
        "eviction_s_per_kv_token": cost_e,
        "eviction_ms_at_max_len": 1e3 * max(run.evictions)[1] if run.evictions else None,
    }


def _print(report: dict[str, Any], payload: dict[str, Any]) -> None:
    """The report in a few lines, with the shapes the model misses most where it is
    not at the machine's limit."""
    console.print(
        f"profiled {report['samples']} steps in {report['measure_s']:.1f} s "
        f"(model load {report['load_s']:.1f} s)\n"
        f"held-out MAPE, step-cost model: all {pct_text(report['batch_model_mape_pct'])}, "
        f"prompts {pct_text(report['model_prefill_mape_pct'])}, "
        f"decodes {pct_text(report['model_decode_mape_pct'])}, "
        f"mixed {pct_text(report['model_mixed_mape_pct'])}; TimeBill's ETE form: whole prompts "
        f"{pct_text(report['ete_prefill_mape_pct'])}, one-sequence decodes "
        f"{pct_text(report['ete_decode_mape_pct'])}\n"
        f"{report['verdict']} (the floor: the larger of identical steps repeated at the "
        f"start and the end, whose median moved {pct_text(report['noise_drift_pct'])}, and the "
        f"serving run's steps of one shape, {pct_text(report['repeat_floor_pct'])} spread)\n"
        f"SnapKV eviction {1e6 * report['eviction_s_per_kv_token']:.1f} µs per KV token held"
    )
    shape = payload.get("attention")
    if isinstance(shape, dict):
        console.print(
            f"prompt attention counted as the kernels compute it: {shape['sliding_layers']} "
            f"of {shape['layers']} layers see the last {shape['window']} keys, a chunk of more "
            f"than {shape['block']} rows runs in blocks"
        )
    if report["at_noise_limit"] is False:
        print_misses(report["misses"])


def print_misses(rows: list[dict[str, object]], what: str = "held-out steps", top: int = 8) -> None:
    """The step shapes the model misses most, as a small table."""
    console.print(f"where the model misses most ({what}, by share of the error):")
    head = (
        f"  {'decoders':>9} {'prompt tok':>10} {'steps':>6} {'MAPE %':>7} {'median %':>9} "
        f"{'share %':>8}"
    )
    console.print(head)
    for r in rows[:top]:
        console.print(
            f"  {r['decoders']!s:>9} {r['prompt_tokens']!s:>10} {r['steps']!s:>6} "
            f"{float(r['mape_pct']):>7.1f} {float(r['median_error_pct']):>+9.1f} "  # type: ignore[arg-type]
            f"{float(r['error_share_pct']):>8.1f}"  # type: ignore[arg-type]
        )
