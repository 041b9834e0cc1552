"""The ``--engine`` modes of `duetime bench deferred-prefill` and `duetime bench amin`.

Kept out of ``cli/bench.py`` so those commands only choose a mode: this file
checks the engine options, loads the model, runs the bench module and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duetime.cli.common import out


def _model(spec: str, dtype: str, threads: int, clock: str) -> Any:
    import torch

    from duetime.bench.engine_fit import bench_clock, load_bench_model

    bench_clock(clock, threads)  # a bad clock fails before the model loads
    torch.set_num_threads(threads)
    return load_bench_model(spec, dtype)


def parse_ks(ks: str | None) -> tuple[int, ...] | None:
    """``"1,2,4"`` → ``(1, 2, 4)``; a clear error for anything else."""
    if ks is None:
        return None
    try:
        vals = tuple(int(x) for x in ks.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--ks {ks!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not vals:
        raise ValueError("--ks is empty")
    return vals


def deferred_prefill(
    *,
    model: str,
    dtype: str,
    threads: int,
    capacity: int,
    prompt_len: int,
    mean_output: float,
    requests: int,
    ks: str | None,
    profile: str | None,
    seed: int,
    clock: str,
    reps: int = 1,
) -> dict[str, Any]:
    """Run the real-engine deferred-prefill curve and print its table and summary."""
    from duetime.bench import deferred_prefill_engine as bench

    k_grid = parse_ks(ks)
    if mean_output <= 1:
        raise ValueError(f"--mean-output must be > 1 token, got {mean_output}")
    eng = _model(model, dtype, threads, clock)
    fig = bench.run(
        eng,
        model_name=f"{model}, {dtype}, {threads} thread(s), {clock} clock",
        clock=clock,
        reps=reps,
        capacity=capacity,
        prompt_len=prompt_len,
        mean_output=mean_output,
        requests=requests,
        ks=k_grid,
        profile=profile,
        seed=seed,
    )
    out.print(bench.table(fig))
    adv, fit = fig["advice"], fig["cost_fit"]
    fitted = f", fit MAPE {fit['fit_mape_pct']:.1f} %" if "fit_mape_pct" in fit else ""
    out.print(
        f"step costs: {fit['source']}{fitted}; c_p = {adv['model_c_p'] * 1e3:.1f} ms, "
        f"t_p·d0/N = {adv['model_prefill_per_prompt'] * 1e3:.1f} ms, "
        f"c_d = {adv['model_c_d'] * 1e3:.1f} ms, t_d = {adv['model_t_d'] * 1e3:.2f} ms"
    )
    out.print(
        f"analytic K* = {adv['k_star']}: ρ(K*) = {adv['throughput_k_star_req_s']:.3f} req/s, "
        f"{adv['gain_vs_k1_pct']:+.1f} % vs K = 1"
    )
    for curve, s in fig["summary"].items():
        star = (
            f"; at K* {s['gain_k_star_vs_k1_pct']:+.1f} % throughput, "
            f"{s['completion_change_k_star_vs_k1_pct']:+.1f} % completion"
            if "gain_k_star_vs_k1_pct" in s
            else ""
        )
        out.print(
            f"{curve}: best K = {s['k_best']}, {s['gain_best_vs_k1_pct']:+.1f} % throughput and "
            f"{s['completion_change_best_vs_k1_pct']:+.1f} % completion time vs K = 1{star}; "
            f"max |error| vs Theorem 1 {s['max_abs_error_vs_theorem1_pct']:.1f} %"
        )
    out.print(
        f"paper (vLLM, A100): +13.5 % throughput, -14 % completion time at its best K; "
        f"wall {fig['wall_s']:.1f} s (a shared machine: the real curve is noisy; "
        "--clock cpu counts only this process's CPU seconds)"
    )
    return fig


def amin(
    *,
    model: str,
    dtype: str,
    threads: int,
    requests: int,
    kv_capacity: int,
    max_prompt: int,
    max_output: int,
    intervals: str,
    profile: str | None,
    seed: int,
    plot: Path | None,
    clock: str,
    reps: int = 1,
) -> dict[str, Any]:
    """Run H-SF / Amax / Amin on the engine beside the simulator; print the table."""
    from duetime.bench import amin_engine as bench

    constructions = tuple(c.strip() for c in intervals.split(",") if c.strip())
    if not constructions:
        raise ValueError("--intervals is empty")
    for c in constructions:
        bench.interval_spec(c, max_output)  # raises on an unknown name
    eng = _model(model, dtype, threads, clock)
    fig = bench.run(
        eng,
        model_name=f"{model}, {dtype}, {threads} thread(s), {clock} clock",
        clock=clock,
        reps=reps,
        requests=requests,
        kv_capacity=kv_capacity,
        max_prompt=max_prompt,
        max_output=max_output,
        constructions=constructions,
        profile=profile,
        seed=seed,
    )
    out.print(bench.table(fig))
    fit, w = fig["cost_fit"], fig["workload"]
    fitted = f", fit MAPE {fit['fit_mape_pct']:.1f} %" if "fit_mape_pct" in fit else ""
    out.print(
        f"step costs: {fit['source']}{fitted}; prompts mean {w['prompt_tokens_mean']:.0f} "
        f"(<= {w['max_prompt_tokens']}), outputs mean {w['output_tokens_mean']:.0f} "
        f"(<= {w['max_output_tokens']}) tokens; wall {fig['wall_s']:.1f} s "
        "(a shared machine: real TEL is noisy)"
    )
    if plot is not None:
        bench.plot(fig, plot)
    return fig
