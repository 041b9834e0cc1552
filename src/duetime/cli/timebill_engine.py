"""`duetime bench timebill --engine`: load the engine, run the real-engine bench, print and save.

Kept out of ``cli/bench.py`` so the simulator command stays short; the bench
itself is :mod:`duetime.bench.timebill_engine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duetime.cli.common import out

MODELS = ("gemma", "tiny")
DTYPES = ("fp32", "fast", "bf16", "int8")


def load(model: str, dtype: str, threads: int) -> Any:
    """The packaged Gemma 3 270M (``gemma``) or a tiny random-weight one (``tiny``: tests)."""
    if model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    import torch

    torch.set_num_threads(threads)
    if model == "tiny":
        from duetime.engine.testing import engine_from_hf, tiny_hf_model

        return engine_from_hf(tiny_hf_model(seed=0), dtype)  # type: ignore[arg-type]
    from duetime.engine import load_model

    return load_model(dtype=dtype, progress=False)  # type: ignore[arg-type]


def run_cli(
    *,
    model: str,
    dtype: str,
    threads: int,
    prompts: int,
    n_max: int,
    min_prompt: int,
    max_prompt: int,
    methods: list[str] | None,
    budgets: list[float] | None,
    budget_scale: str,
    predictor: str,
    profile: str | None,
    seed: int,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Validate, run, print the tables and the predictor timing, write JSON and PNG."""
    from duetime.bench import timebill as sim_bench
    from duetime.bench import timebill_engine as bench
    from duetime.metrics import write_json

    if min_prompt > max_prompt:
        raise ValueError(f"--min-prompt {min_prompt} > --max-prompt {max_prompt}")
    bad = [m for m in methods or () if m not in sim_bench.METHODS]
    if bad:
        raise ValueError(f"unknown --method {bad}; choose from {', '.join(sim_bench.METHODS)}")
    if budget_scale not in bench.BUDGET_SCALES:
        raise ValueError(f"--budget-scale must be job or step, got {budget_scale!r}")
    cost = None
    if profile is not None:
        from duetime.sim.profiles import load_profile

        cost, _ = load_profile(profile)
    m = load(model, dtype, threads)
    jobs = None
    if model == "tiny":
        jobs = bench.fold_ids(bench.workload(prompts, n_max, min_prompt, max_prompt, seed), m)
    fig = bench.run(
        m, prompts=prompts, n_max=n_max, min_prompt=min_prompt, max_prompt=max_prompt,
        seed=seed, methods=tuple(methods or sim_bench.METHODS), budgets=budgets,
        budget_scale=budget_scale, predictor=predictor, cost=cost, jobs=jobs,
    )  # fmt: skip
    fig.update({"model": model, "dtype": dtype, "threads": threads})
    w, pt = fig["workload"], fig["predictor_timing"]
    out.print(
        f"{w['jobs']} ShareGPT prompts (mean {w['prompt_tokens_mean']:.0f} tokens), outputs "
        f"<= N_max {fig['n_max_tokens']} (mean {w['output_tokens_mean']:.0f}), EOS ignored; "
        f"{model} {dtype}, {threads} threads, eviction {fig['eviction']}; decode step "
        f"{1000 * fig['decode_step_s']:.1f} ms"
    )
    for t in bench.table(fig):
        out.print(t)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    out.print(
        f"predictor ({fig['predictor']}) beside prefill: t_Predict p50 {ms(pt['predict_p50_s'])} "
        f"/ p90 {ms(pt['predict_p90_s'])} ms, t_prefill p50 {ms(pt['prefill_p50_s'])} / p90 "
        f"{ms(pt['prefill_p90_s'])} ms, engine waited p90 {ms(pt['wait_p90_s'])} ms; "
        f"{pt['predict_exceeded_prefill']} of {pt['predictions']} predictions outlasted the "
        f"prefill; compressed inputs: {pt.get('compressed_calls', '-')}"
    )
    out.print(
        f"budgets {fig['budgets_s']} s ({fig['budget_scale']} scaling; step scaling would give "
        f"{fig['budgets_step_s']} s); wall {fig['wall_s']:.1f} s"
    )
    if plot is not None:
        bench.plot(fig, plot)
    if json_path is not None:
        write_json(json_path, fig)
