"""`duetime bench deferred-prefill --engine`: throughput vs K on the real engine, small scale.

The paper's validation (Mohanty et al., EuroMLSys 2025, Sec. 5) puts three
curves side by side: analytic ρ(K), a simulation of the model, and the real
server. Here all three are for *this* engine:

1. its step costs are timed first (prefill phases of ``m`` prompts alone, as
   the stalled phase runs them, and decode steps of ``X`` sequences) and
   fitted to the simulator's linear step cost, or read from ``--profile``;
2. ``analytic``: Theorem 1 with the parameters that cost gives
   (:meth:`DeferredPrefillModel.from_cost`);
3. ``sim-engine``: the simulator on the very jobs the engine runs, with the
   fitted costs;
4. ``real``: the engine itself (:class:`EngineExecutor`, the same
   ``deferred-prefill`` policy object type, the same snapshot).

Jobs are the paper's: prompts of ``d₀`` tokens (BOS + random ordinary ids),
``1 + Geometric(α)`` output tokens (EOS ignored: the length is the job's),
all waiting at t = 0, so the queue stays backlogged. Throughput and
completion times come from :func:`duetime.bench.deferred_prefill.window_metrics`
for both the simulator and the engine: whole renewal cycles between the first
and the last prefill; completion from prefill start to last token.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duetime.analysis.deferred_prefill import DeferredPrefillModel, advise, departure_alpha
from duetime.bench.deferred_prefill import (
    UNLIMITED,
    curve_summary,
    geometric_jobs,
    measure,
    window_metrics,
)
from duetime.bench.engine_fit import (
    CLOCKS,
    Shape,
    check_context,
    fit_cost,
    median_runs,
    read_profile,
    time_shapes,
    warm_up,
    with_synthetic_ids,
)
from duetime.bench.limits import check_engine_requests
from duetime.core.request import Job

K_GRID = (1, 2, 4, 8, 12)  # plus the analytic K*: 6 runs of ~40 s at C = 16
REPS = 3


def timed_contexts(prompt_len: int, mean_output: float) -> list[int]:
    """The decoders' contexts :func:`engine_costs` times: a fresh one and a late one."""
    return sorted({prompt_len + 1, prompt_len + max(2, round(2 * (mean_output - 1)))})


def check_options(
    *,
    capacity: int,
    prompt_len: int,
    mean_output: float,
    requests: int,
    ks: tuple[int, ...] | None,
    reps: int,
    seed: int,
    context: int,
    timed: bool = True,
) -> None:
    """Refuse a run that cannot work, before anything is timed (or, from the CLI, loaded).

    ``context``: the model's positions; every job (``prompt_len`` + its output)
    must fit, and so must the decode steps timed for the cost fit (``timed``:
    no ``--profile``). Without this check ``--mean-output 1e6`` ended in a torch
    allocation error and ``1e18`` in "Storage size calculation overflowed".
    """
    check_engine_requests(requests)
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    if requests < 2 * capacity:
        raise ValueError(
            f"--requests {requests} is too few for C = {capacity}: need >= {2 * capacity} so "
            "that whole refill cycles fit between the first and the last prefill"
        )
    if prompt_len < 2:
        raise ValueError(f"--prompt-len must be >= 2 (BOS + a token), got {prompt_len}")
    if ks is not None and any(not 1 <= k <= capacity for k in ks):
        raise ValueError(f"--ks {','.join(map(str, ks))}: every K must be in 1..C = {capacity}")
    if not math.isfinite(mean_output):
        raise ValueError(f"--mean-output must be finite, got {mean_output}")
    alpha = departure_alpha(mean_output)  # refuses a mean under 2 tokens, as advise does
    what = f"--prompt-len {prompt_len} + --mean-output {mean_output:g}"
    # The mean alone first: drawing 1e18-token outputs would overflow int64.
    check_context(prompt_len + math.ceil(mean_output), context, what)
    jobs = geometric_jobs(requests, alpha, prompt_len, seed)
    longest = max(j.output_len for j in jobs)
    check_context(prompt_len + longest, context, f"{what} (longest output {longest:,} tokens)")
    if timed:  # the cost fit's late decoders, over REPS + 1 timed steps
        late = timed_contexts(prompt_len, mean_output)[-1] + REPS + 2
        check_context(late, context, f"{what} (timing decode steps at 2x the mean)")


def engine_costs(
    model: Any,
    capacity: int,
    prompt_len: int,
    mean_output: float,
    profile: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Any, dict[str, Any]]:
    """This engine's step cost: read from ``profile``, or timed at the shapes the run uses.

    Prefill phases of ``m`` prompts alone (the stalled phase) and decode steps
    of ``X`` sequences at a fresh and at a late context, ``m, X`` in
    ``{1, 2, C/2, C}``.
    """
    if profile is not None:
        return read_profile(profile)
    sizes = sorted({1, 2, max(1, capacity // 2), capacity})
    ctx = timed_contexts(prompt_len, mean_output)
    shapes: list[Shape] = [((prompt_len,) * m, 0, 0) for m in sizes]
    shapes += [((), x, c) for x in sizes for c in ctx]
    return fit_cost(time_shapes(model, shapes, REPS, clock), name="engine-fitted", model=model)


def run_real(
    model: Any,
    jobs: list[Job],
    capacity: int,
    k: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """One backlogged run of policy K on the engine; the same figures as the simulator's."""
    from duetime.engine.executor import EngineExecutor
    from duetime.policies import make_policy

    with tempfile.TemporaryDirectory(prefix="duetime-dp-") as d:
        tel = Path(d) / "steps.jsonl"
        ex = EngineExecutor(
            make_policy("deferred-prefill", k=k),
            model,
            kv_capacity=UNLIMITED,
            max_num_seqs=capacity,
            max_batch_tokens=UNLIMITED,
            telemetry=tel,
            clock=clock,
        )
        res = ex.run(copy.deepcopy(jobs))
        steps = [json.loads(line) for line in tel.read_text().splitlines()]
    unfinished = [r.request.rid for r in res.records if r.finish is None]
    if unfinished:
        raise RuntimeError(f"K={k}: {len(unfinished)} requests did not finish on the engine")
    # A prefill phase's end (= its requests' first-token time) → the phase's duration.
    phase = {s["t_s"]: s["step_s"] for s in steps if s["prefill_tokens"] > 0}
    firsts = [float(r.first_token or 0.0) for r in res.records]
    prefill = {t: phase[round(t, 6)] for t in firsts}
    return {
        **window_metrics(res.records, prefill, k),
        "run_s": res.wall_s,  # on the bench clock (cpu or wall seconds)
        "engine_steps": res.engine_steps,
        "prefill_phases": len(phase),
        "kv_peak_tokens": res.kv_peak,
        "kv_left_tokens": ex.kv.total_tokens,
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One K's repetitions: the median of every figure, and the spread of throughput."""
    out = median_runs(rows)
    out["k"] = rows[0]["k"]
    out["throughput_reps_req_s"] = [r["throughput_req_s"] for r in rows]
    return out


def run(
    model: Any,
    *,
    model_name: str,
    capacity: int = 16,
    prompt_len: int = 16,
    mean_output: float = 9.0,
    requests: int = 80,
    ks: tuple[int, ...] | None = None,
    profile: str | None = None,
    seed: int = 0,
    clock: str = "wall",
    reps: int = 1,
) -> dict[str, Any]:
    """Analytic, simulated and real throughput over K for this engine; units in the keys.

    ``clock`` times the engine (steps and runs alike): ``wall`` or ``cpu``
    (this process's CPU seconds, see :data:`duetime.bench.engine_fit.CLOCKS`).
    ``reps`` > 1 runs the K grid that many times, interleaved (every K once,
    then again), so a load change hits all K alike; rows hold the medians.
    """
    check_options(
        capacity=capacity, prompt_len=prompt_len, mean_output=mean_output, requests=requests,
        ks=ks, reps=reps, seed=seed, context=model.config.max_position_embeddings,
        timed=profile is None,
    )  # fmt: skip
    t_start = time.perf_counter()
    tick = CLOCKS[clock]
    warm_up(model)
    cost, cost_info = engine_costs(model, capacity, prompt_len, mean_output, profile, tick)
    dp = DeferredPrefillModel.from_cost(cost, capacity, mean_output, prompt_len)
    adv = advise(dp)
    grid = sorted(
        {k for k in (ks or K_GRID) if k <= capacity}
        | {1}
        | ({adv["k_star"]} if ks is None else set())
    )
    cfg = model.config
    jobs = with_synthetic_ids(
        geometric_jobs(requests, dp.alpha, prompt_len, seed), cfg.vocab_size, cfg.bos_token_id, seed
    )
    simulated: list[dict[str, Any]] = [
        {"curve": "sim-engine", **measure(copy.deepcopy(jobs), cost, capacity, k)} for k in grid
    ]
    runs = [[run_real(model, jobs, capacity, k, tick) for k in grid] for _ in range(reps)]
    real = [median_row([rep[i] for rep in runs]) for i in range(len(grid))]
    analytic = [
        {
            "k": k,
            "throughput_req_s": dp.throughput(k),
            "throughput_approx_req_s": dp.throughput_approx(k),
        }
        for k in range(1, capacity + 1)
    ]
    exact = {r["k"]: r["throughput_req_s"] for r in analytic}
    sim_by = {int(r["k"]): r for r in simulated}
    for r in real:
        r["throughput_vs_sim_pct"] = 100 * (
            r["throughput_req_s"] / sim_by[r["k"]]["throughput_req_s"] - 1
        )
        r["throughput_vs_theorem1_pct"] = 100 * (r["throughput_req_s"] / exact[r["k"]] - 1)
    return {
        "mode": "engine",
        "profile": cost.name if profile is None else profile,
        "engine": {"model": model_name, "vocab": cfg.vocab_size, "clock": clock},
        "capacity": capacity,
        "requests": requests,
        "seed": seed,
        "workload": {
            "prompt_tokens": prompt_len,
            "output_tokens_mean_target": mean_output,
            "output_tokens_mean": sum(j.output_len for j in jobs) / len(jobs),
            "output_distribution": "1 + Geometric(alpha), stratified; EOS ignored",
        },
        "cost": cost.to_profile(),
        "cost_fit": cost_info,
        "advice": adv,
        "summary": {
            "sim-engine": curve_summary(sim_by, adv, exact),
            "real": curve_summary({int(r["k"]): r for r in real}, adv, exact),
        },
        "analytic": analytic,
        "simulated": simulated,
        "real": real,
        "wall_s": time.perf_counter() - t_start,
    }


def table(fig: dict[str, Any]) -> Any:
    """Throughput and completion time per K: Theorem 1, simulated, real."""
    from rich.table import Table

    exact = {r["k"]: r for r in fig["analytic"]}
    sim = {r["k"]: r for r in fig["simulated"]}
    t = Table(
        title=f"deferred prefill on the engine ({fig['engine']['model']}), C = {fig['capacity']}, "
        f"d0 = {fig['workload']['prompt_tokens']}, {fig['requests']} requests",
        caption="throughput in requests/s; completion = prefill start to last token, mean (s)",
    )
    # At 80 columns (a pipe) no_wrap cut every header and dropped K: K never wraps, the
    # figures fold (never cut) and the headers wrap at their spaces.
    for col in ("K", "Thm 1", "sim", "real", "real / sim", "real tok/s", "sim compl s",
                "real compl s"):  # fmt: skip
        t.add_column(col, justify="right", overflow="fold", no_wrap=col == "K")
    for r in fig["real"]:
        k = r["k"]
        t.add_row(
            str(k),
            f"{exact[k]['throughput_req_s']:.3f}",
            f"{sim[k]['throughput_req_s']:.3f}",
            f"{r['throughput_req_s']:.3f}",
            f"{r['throughput_vs_sim_pct']:+.1f}%",
            f"{r['throughput_tok_s']:.1f}",
            f"{sim[k]['completion_mean_s']:.2f}",
            f"{r['completion_mean_s']:.2f}",
        )
    return t
