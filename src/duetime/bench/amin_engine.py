"""`duetime bench amin --engine`: H-SF, Amax and Amin on the real engine, small scale.

The policies are the simulator's (Chen, Ye, Zhou 2025; see
:mod:`duetime.bench.amin`), driven by :class:`EngineExecutor` through the
same snapshot: a handful of ShareGPT prompts, all waiting at t = 0, under a
KV budget ``M`` small enough that the memory rule (constraint 1) binds, so
Amax holds requests back and Amin cancels and restarts them.

For each policy we report the real total end-to-end latency (TEL, the sum of
completion times) next to the simulator's prediction for the very same jobs,
with this engine's step costs (timed here, or ``--profile``), and each TEL's
ratio to H-SF's. Intervals are the paper's constructions scaled to the
output cap (``rough`` = ``[1, max_output]``, ``bins10`` = ten bins up to the
cap, ``overlap-x`` unchanged), because Amax could never admit a
1,000-token upper bound into a few hundred tokens of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from duetime.bench.amin import _fresh, _row
from duetime.bench.engine_fit import (
    CLOCKS,
    Shape,
    check_context,
    fit_cost,
    fold_ids,
    median_runs,
    read_profile,
    time_shapes,
    warm_up,
)
from duetime.bench.limits import check_engine_requests
from duetime.core.request import Job

UNLIMITED = 1 << 40
CONSTRUCTIONS = ("rough", "bins10", "overlap-0.1", "overlap-0.95", "overlap-0.99")


def interval_spec(construction: str, max_output: int) -> str:
    """The predictor spec of a construction, scaled to outputs of at most ``max_output``.

    Raises ValueError naming ``--intervals`` for an unknown construction or a
    bad width (``overlap-nan``), so the CLI can check before the model loads.
    """
    from duetime.predict.intervals import make_interval_predictor

    if construction == "rough":
        spec = f"interval:rough:1:{max_output}"
    elif construction == "bins10":
        spec = f"interval:bins:{max(1, -(-max_output // 10))}"
    elif construction.startswith("overlap-"):
        spec = f"interval:overlap:{construction.removeprefix('overlap-')}"
    else:
        raise ValueError(
            f"--intervals: unknown interval construction {construction!r}; use "
            f"{', '.join(CONSTRUCTIONS)} (overlap-<x> for any x in [0, 1))"
        )
    try:
        make_interval_predictor(spec)
    except ValueError as e:
        raise ValueError(f"--intervals {construction!r}: {e}") from None
    return spec


def sharegpt_engine_jobs(
    n: int, seed: int, max_prompt: int, max_output: int, vocab: int | None
) -> list[Job]:
    """ShareGPT pairs within the caps, tokenised, all arriving at t = 0.

    ``vocab``: fold the ids into a smaller test vocabulary; ``None`` keeps
    Gemma's ids (lengths are the same either way).
    """
    from duetime import workloads as wl

    caps = wl.LengthCaps(max_prompt_len=max_prompt, max_output_len=max_output)
    jobs = wl.build_jobs(
        n,
        arrivals=wl.AllAtOnce(),
        seed=seed,
        caps=caps,
        max_tokens=max_output,
        with_prompt_ids=True,
    )
    return jobs if vocab is None else fold_ids(jobs, vocab)


def engine_costs(
    model: Any,
    max_prompt: int,
    max_output: int,
    profile: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Any, dict[str, Any]]:
    """Step costs of this engine at the run's shapes (prefill, decode, mixed), or a profile."""
    if profile is not None:
        return read_profile(profile)
    half, ctx = max(8, max_prompt // 2), max_prompt + max_output
    shapes: list[Shape] = [((p,), 0, 0) for p in sorted({16, half, max_prompt})]
    shapes += [((), d, c) for d in (1, 2, 4, 8) for c in (half, ctx)]
    shapes += [((half,), 2, ctx // 2), ((max_prompt,), 4, ctx // 2), ((16,), 4, ctx)]
    return fit_cost(time_shapes(model, shapes, 2, clock), name="engine-fitted", model=model)


def check_fits(jobs: list[Job], specs: dict[str, str], memory: int) -> None:
    """Every job must fit ``memory`` at its peak, also as Amax sizes it (prompt + upper bound)."""
    from duetime.predict.oracle import make_job_predictor

    need = max(j.request.prompt_len + j.output_len for j in jobs)
    if need > memory:
        raise ValueError(f"--kv-capacity {memory}: a request needs {need} tokens at its peak")
    for name, spec in specs.items():
        pred = make_job_predictor(spec)
        assert pred is not None
        hi = max(j.request.prompt_len + pred.predict_job(j).hi for j in jobs)
        if hi > memory:
            raise ValueError(
                f"--kv-capacity {memory}: under {name} intervals Amax reserves up to {hi:.0f} "
                "tokens for one request and would never admit it; raise M or lower --max-output"
            )


def check_options(
    *,
    requests: int,
    seed: int,
    kv_capacity: int,
    max_prompt: int,
    max_output: int,
    constructions: tuple[str, ...],
    context: int,
) -> dict[str, str]:
    """Refuse a run that cannot work, before the model loads; the constructions' specs.

    Token ids do not change a job's length, so the fit against ``--kv-capacity``
    (:func:`check_fits`) needs no model; ``context`` is the model's positions.
    """
    check_engine_requests(requests)
    if not constructions:
        raise ValueError("--intervals is empty")
    specs = {c: interval_spec(c, max_output) for c in constructions}
    jobs = sharegpt_engine_jobs(requests, seed, max_prompt, max_output, None)
    longest = max(jobs, key=lambda j: j.request.prompt_len + j.output_len)
    check_context(
        longest.request.prompt_len + longest.output_len,
        context,
        f"--max-prompt {max_prompt}, --max-output {max_output}: a request of "
        f"{longest.request.prompt_len} prompt and {longest.output_len} output tokens",
    )
    check_fits(jobs, specs, kv_capacity)
    return specs


def run_real(
    model: Any,
    jobs: list[Job],
    policy: str,
    predictor: str,
    memory: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """One engine run of ``policy`` under KV budget ``memory``."""
    from duetime.engine.executor import EngineExecutor
    from duetime.policies import make_policy
    from duetime.predict.oracle import make_job_predictor

    ex = EngineExecutor(
        make_policy(policy, seed=seed),
        model,
        kv_capacity=memory,
        max_num_seqs=UNLIMITED,
        max_batch_tokens=UNLIMITED,
        predictor=make_job_predictor(predictor, seed=seed),
        clock=clock,
    )
    res = ex.run(_fresh(jobs))
    ends = [r.e2e for r in res.records if r.e2e is not None]
    tel = float(sum(ends))
    return {
        "requests": len(res.records),
        "completed": len(ends),
        "tel_s": tel,
        "mean_latency_s": tel / max(len(ends), 1),
        "makespan_s": max(ends, default=0.0),  # every request arrives at t = 0
        "restarts": res.counters.get("restarts", 0),
        "engine_steps": res.engine_steps,
        "kv_peak_tokens": res.kv_peak,
        "kv_left_tokens": ex.kv.total_tokens,
        "run_s": res.wall_s,  # on the bench clock (cpu or wall seconds)
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated real runs of one policy: medians, plus every run's TEL and restarts."""
    import numpy as np

    out = median_runs(runs)
    for k in ("requests", "completed", "engine_steps", "restarts", "kv_peak_tokens"):
        out[k] = int(np.median([r[k] for r in runs]))
    out["tel_reps_s"] = [r["tel_s"] for r in runs]
    out["restarts_reps"] = [r["restarts"] for r in runs]
    return out


def run_sim(
    jobs: list[Job], policy: str, predictor: str, cost: Any, memory: int, seed: int
) -> dict[str, Any]:
    """The simulator's prediction for the same jobs, with this engine's step costs."""
    from duetime.analysis.amin_model import exact_config
    from duetime.policies import make_policy
    from duetime.predict.oracle import make_job_predictor
    from duetime.sim import Simulator

    pol = make_policy(policy, seed=seed)
    res = Simulator(pol, cost, exact_config(memory), make_job_predictor(predictor, seed=seed)).run(
        _fresh(jobs)
    )
    return _row(res)


def run(
    model: Any,
    *,
    model_name: str,
    clock: str = "wall",
    profile: str | None = None,
    reps: int = 1,
    requests: int = 12,
    seed: int = 0,
    kv_capacity: int = 224,
    max_prompt: int = 256,
    max_output: int = 48,
    constructions: tuple[str, ...] = ("overlap-0.95",),
) -> dict[str, Any]:
    """H-SF, then Amax and Amin per construction: real TEL vs the simulator's.

    First the engine and how it is timed, then the workload. ``clock``: ``wall`` or
    ``cpu`` (see :data:`duetime.bench.engine_fit.CLOCKS`); ``profile``: its step costs
    (timed when None); ``reps`` > 1 repeats the real runs, interleaved, and rows hold
    the medians.
    """
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    check_engine_requests(requests)
    specs = {c: interval_spec(c, max_output) for c in constructions}
    t0 = time.perf_counter()
    jobs = sharegpt_engine_jobs(requests, seed, max_prompt, max_output, model.config.vocab_size)
    check_fits(jobs, specs, kv_capacity)
    tick = CLOCKS[clock]
    warm_up(model)
    cost, cost_info = engine_costs(model, max_prompt, max_output, profile, tick)
    runs = [("hsf", "oracle", "oracle")]
    runs += [(p, c, spec) for c, spec in specs.items() for p in ("amax", "amin")]
    # Repetitions interleaved (every policy once, then again) so a load change hits all alike.
    reals = [[run_real(model, jobs, p, spec, kv_capacity, seed, tick) for p, _, spec in runs]
             for _ in range(reps)]  # fmt: skip
    rows = []
    for i, (policy, construction, spec) in enumerate(runs):
        real = _median([rep[i] for rep in reals])
        sim = run_sim(jobs, policy, spec, cost, kv_capacity, seed)
        rows.append(
            {
                "policy": policy,
                "construction": construction,
                "predictor": spec,
                "real": real,
                "sim": sim,
                "tel_sim_vs_real_pct": 100 * (sim["tel_s"] / real["tel_s"] - 1),
            }
        )
    for side in ("real", "sim"):
        hsf = rows[0][side]["tel_s"]
        for r in rows:
            r[side]["tel_ratio_vs_hsf"] = r[side]["tel_s"] / hsf
    p = [j.request.prompt_len for j in jobs]
    o = [j.output_len for j in jobs]
    return {
        "mode": "engine",
        "engine": {"model": model_name, "vocab": model.config.vocab_size, "clock": clock},
        "workload": {
            "source": "ShareGPT (first human/gpt pair) within the caps, all arriving at t = 0",
            "requests": requests,
            "seed": seed,
            "max_prompt_tokens": max_prompt,
            "max_output_tokens": max_output,
            "prompt_tokens_mean": sum(p) / len(p),
            "output_tokens_mean": sum(o) / len(o),
            "tokens_at_peak_sum": sum(p) + sum(o),
        },
        "kv_capacity_tokens": kv_capacity,
        "profile": cost.name if profile is None else profile,
        "cost": cost.to_profile(),
        "cost_fit": {k: v for k, v in cost_info.items() if k != "samples"},
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }


def table(fig: dict[str, Any]) -> Any:
    """TEL real vs simulated per policy, and each side's ratio to H-SF."""
    from rich.table import Table

    w = fig["workload"]
    t = Table(
        title=f"Amin / Amax / H-SF on the engine ({fig['engine']['model']}): {w['requests']} "
        f"ShareGPT requests, M = {fig['kv_capacity_tokens']} tokens",
        caption="TEL = sum of completion times (s); ratios: TEL / TEL(H-SF) on each side; "
        "restarts real/sim; KV peak real (tokens)",
    )
    # At 80 columns (a pipe) "…" cut every construction to "overl…": the two key columns
    # never wrap, the figures fold (never cut) and the headers wrap at their spaces.
    for col in ("policy", "intervals", "TEL real", "TEL sim", "sim / real", "real / HSF",
                "sim / HSF", "restarts", "KV peak"):  # fmt: skip
        key = col in ("policy", "intervals")
        t.add_column(col, justify="left" if key else "right", overflow="fold", no_wrap=key)
    for r in fig["rows"]:
        re, si = r["real"], r["sim"]
        t.add_row(
            r["policy"],
            r["construction"],
            f"{re['tel_s']:.1f}",
            f"{si['tel_s']:.1f}",
            f"{r['tel_sim_vs_real_pct']:+.0f}%",
            f"{re['tel_ratio_vs_hsf']:.3f}",
            f"{si['tel_ratio_vs_hsf']:.3f}",
            f"{re['restarts']}/{si['restarts']}",
            str(re["kv_peak_tokens"]),
        )
    return t


def plot(fig: dict[str, Any], path: Any) -> Any:
    """TEL per policy, real beside simulated, and the ratios to H-SF."""
    import numpy as np
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    rows = fig["rows"]
    labels = [
        r["policy"] if r["policy"] == "hsf" else f"{r['policy']}\n{r['construction']}" for r in rows
    ]
    x = np.arange(len(rows))
    f = Figure(figsize=(10, 4.2))
    for i, (key, ylabel) in enumerate(
        (("tel_s", "TEL (s)"), ("tel_ratio_vs_hsf", "TEL / TEL(H-SF)"))
    ):
        ax = f.add_subplot(1, 2, i + 1)
        for j, side in enumerate(("real", "sim")):
            label = "real engine" if side == "real" else "simulator, fitted costs"
            bars = ax.bar(x + (j - 0.5) * 0.38, [r[side][key] for r in rows], 0.38, label=label)
            ax.bar_label(bars, fmt="%.2f" if i else "%.0f", fontsize=7)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    w = fig["workload"]
    return save_titled_png(
        f,
        path,
        f"Amin / Amax / H-SF on the engine ({fig['engine']['model']}): {w['requests']} ShareGPT "
        f"requests, M = {fig['kv_capacity_tokens']} tokens",
    )
