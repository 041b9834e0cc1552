"""`duetime bench timebill`: TimeBill's comparison (Sec. 6.4, Fig. 7) on the simulator.

Methods (``../shared/seeds/timebill.txt`` Sec. 6.1), all the ``timebill`` policy:

- ``vanilla``: no eviction (``fixed_alpha=0``);
- ``alpha=25%`` … ``alpha=95%``: fixed-ratio KV eviction after prefill;
- ``timebill``: α* of Eq. 11 from the WCET length ``min(k·N̂, N_max)``, ``k = 5``;
- ``timebill-k1``: the same with ``k = 1`` (the paper's Sec. 6.5 knob), to show the
  adaptivity that ``k = 5`` hides when ``5·N̂`` reaches ``N_max``.

Each under both overrun strategies, Kill and Skip-Next. AWQ is not modelled.

Workload: one periodic task (``tasks`` of them, phase-shifted, when asked). Job ``j`` is
released at ``j·T`` with the implicit deadline ``(j + 1)·T`` (time budget ``T``, period
``T``); its prompt and true output length are a ShareGPT pair with a long prompt (>= 1,024
tokens: the paper runs LongBench's long contexts; ShareGPT has 910 such pairs) and an output
of at most ``N_max`` tokens. The same pairs, in the same order, are played for every method,
budget and strategy; the length predictor (``noisy`` by default: the truth times a
log-normal error of σ = 0.3, the stand-in for the paper's RLP) is re-seeded per run.

Budgets: the paper's ``T`` = 5…10 s on an A40 with Qwen2.5-7B are scaled by the ratio of
decode-step times, ``(c0 + b) / 27 ms``; 27 ms is our estimate of Qwen2.5-7B's bf16 weights
(15.2 GB) read at ~80 % of the A40's 696 GB/s, not a measurement.

Completion (the paper's completion rate): under Kill a job completes when it finishes by
its deadline; under Skip-Next when it finishes at all (an overrunning job runs on and
answers late; the jobs it makes skip are incomplete). ``on_time_rate`` (finished by the
deadline) is reported for both. There is no text in the simulator, so no response-quality
score: ``mean_alpha`` (the mean eviction ratio of the jobs that reached decoding) stands in
for what quality is traded; the F1 / ROUGE-L score is in the real-engine mode
(:mod:`duetime.bench.timebill_engine`, `duetime bench timebill --engine`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.request import Job, Request

PAPER_BUDGETS_S = (5.0, 6.0, 7.0, 8.0, 9.0, 10.0)
PAPER_STEP_S = 0.027  # estimated Qwen2.5-7B bf16 decode step on an A40 (see the docstring)
METHODS: dict[str, dict[str, Any]] = {
    "vanilla": {"fixed_alpha": 0.0},
    "alpha=25%": {"fixed_alpha": 0.25},
    "alpha=50%": {"fixed_alpha": 0.5},
    "alpha=75%": {"fixed_alpha": 0.75},
    "alpha=95%": {"fixed_alpha": 0.95},
    "timebill": {"k": 5.0},
    "timebill-k1": {"k": 1.0},
}
STRATEGIES = ("kill", "skip-next")
MIN_PROMPT = 1024
N_MAX = 1024
PAPER = {
    "claim": "TimeBill: highest average score, completion rate similar to alpha=95% "
    "(Fig. 7; read off a plot, no table)",
    "budgets_s": list(PAPER_BUDGETS_S),
}


#: Which ShareGPT rows the simulated jobs come from: any, or only those no shipped length
#: predictor trained on (the fair draw for ``--predictor learned``).
ROWS = ("all", "heldout")


def pairs(
    n: int, seed: int, with_text: bool = False, rows: str = "all"
) -> list[tuple[int, int, str | None]]:
    """``n`` ShareGPT (prompt_len, output_len, prompt text) triples, prompt >= 1,024 tokens,
    output <= N_max. The text (for the ``learned`` predictor) only when asked. ``rows``
    "heldout" draws from the RLP's test rows only, each once: at most as many jobs as
    there are such rows (87 of the 906 that fit)."""
    from duetime import workloads as wl

    if rows not in ROWS:
        raise ValueError(f"--rows must be one of {', '.join(ROWS)}, got {rows!r}")
    caps = wl.LengthCaps(min_prompt_len=MIN_PROMPT, max_output_len=N_MAX)
    source = None
    if rows == "heldout":
        from duetime.predict.length_data import heldout_pool

        lengths = wl.load_sharegpt_lengths(progress=False)
        pool = heldout_pool(lengths, caps)
        source = wl.ShareGPTSource(lengths, pool=pool)
        n = min(n, len(pool))
    jobs = wl.build_jobs(
        n,
        source=source,
        arrivals=wl.AllAtOnce(),
        seed=seed,
        caps=caps,
        max_tokens=N_MAX,
        with_prompt_text=with_text,
    )
    return [(j.request.prompt_len, j.output_len, j.request.prompt_text) for j in jobs]


def periodic_jobs(
    lengths: list[tuple[int, int, str | None]], budget_s: float, tasks: int = 1
) -> list[Job]:
    """Job ``j`` of task ``m`` released at ``(j + m/tasks)·T``, deadline one period later."""
    jobs = []
    for i, (prompt, output, text) in enumerate(lengths):
        m, j = i % tasks, i // tasks
        release = (j + m / tasks) * budget_s
        req = Request(
            rid=i,
            arrival=release,
            prompt_len=prompt,
            max_tokens=N_MAX,
            deadline=release + budget_s,
            klass=f"task{m}",
            prompt_text=text,
        )
        jobs.append(Job(request=req, output_len=output))
    return jobs


#: Longest time budget taken, in seconds (11.6 days): far past any job here (the paper's
#: are 5-10 s), and far from where the plots' axes break (1e308 ran, printed, then failed
#: in matplotlib's tick arithmetic and wrote no JSON).
MAX_BUDGET_S = 1e6


def check_budgets(budgets: Sequence[float] | None) -> None:
    """Refuse a time budget that is no period: 0, negative, NaN, infinite or past 1e6 s."""
    if budgets is not None and not all(math.isfinite(b) and 0 < b <= MAX_BUDGET_S for b in budgets):
        got = ", ".join(f"{b:g}" for b in budgets)
        raise ValueError(f"--budget must be finite, > 0 and <= {MAX_BUDGET_S:g} s, got {got}")


def scaled_budgets(cost: Any) -> list[float]:
    """The paper's 5…10 s scaled by this profile's decode step over the A40's."""
    scale = (cost.c0 + cost.b) / PAPER_STEP_S
    return [round(t * scale, 3) for t in PAPER_BUDGETS_S]


def run_one(
    method: str,
    overrun: str,
    budget_s: float,
    lengths: list[tuple[int, int, str | None]],
    cost: Any,
    cfg: Any,
    predictor: str,
    seed: int,
    tasks: int,
) -> dict[str, Any]:
    """Simulate one (method, overrun strategy, budget) and score it."""
    from duetime.policies import make_policy
    from duetime.predict.oracle import make_job_predictor
    from duetime.sim import Simulator

    jobs = periodic_jobs(lengths, budget_s, tasks)
    pol = make_policy("timebill", overrun=overrun, **METHODS[method])
    sim = Simulator(pol, cost, cfg, predictor=make_job_predictor(predictor, seed=seed))
    res = sim.run(jobs)
    return {
        "method": method,
        "overrun": overrun,
        "budget_s": budget_s,
        **outcome_fields(res.records, overrun),
        "kv_peak_tokens": res.kv_peak,
        "sim_time_s": res.sim_time,
    }


def outcome_fields(recs: list[Any], overrun: str) -> dict[str, Any]:
    """Completion (the paper's, per overrun strategy), kills, skips and α of one run's records.

    Shared with the real-engine bench (:mod:`duetime.bench.timebill_engine`)."""
    n = len(recs)
    on_time = sum(1 for r in recs if r.deadline_met)
    started = [r for r in recs if r.first_token is not None]
    done = [r for r in recs if is_complete(r, overrun)]
    return {
        "jobs": n,
        "completion_rate": len(done) / n,
        "on_time_rate": on_time / n,
        "killed_rate": sum(1 for r in recs if r.cancelled_at is not None and r.first_token) / n,
        "skipped_rate": sum(1 for r in recs if r.cancelled_at is not None and r.first_token is None)
        / n,
        "mean_alpha": float(np.mean([r.kv_evicted_ratio for r in started])) if started else 0.0,
        "mean_alpha_completed": (
            float(np.mean([r.kv_evicted_ratio for r in done])) if done else 0.0
        ),
        "e2e_mean_completed_s": float(np.mean([r.e2e for r in done if r.e2e is not None]))
        if done
        else None,
    }


def is_complete(rec: Any, overrun: str) -> bool:
    """Kill: finished by the deadline. Skip-Next: finished at all (late answers count)."""
    return bool(rec.deadline_met if overrun == "kill" else rec.completed)


def summarize(
    rows: Sequence[dict[str, Any]],
    strategies: Sequence[str],
    methods: Sequence[str],
    keys: Sequence[str],
) -> dict[str, dict[str, dict[str, float]]]:
    """Per overrun strategy and method, each of ``keys`` averaged over the budgets
    (as ``<key>_mean``): the summary the simulated and the real-engine TimeBill benches
    both report, so that their figures compare."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for o in strategies:
        summary[o] = {}
        for m in methods:
            mine = [r for r in rows if r["method"] == m and r["overrun"] == o]
            summary[o][m] = {k + "_mean": float(np.mean([r[k] for r in mine])) for k in keys}
    return summary


def run(
    jobs: int = 200,
    seed: int = 0,
    profile: str = "a100-llama2-7b",
    predictor: str = "noisy",
    tasks: int = 1,
    budgets: tuple[float, ...] | None = None,
    methods: tuple[str, ...] = tuple(METHODS),
    rows: str = "all",
) -> dict[str, Any]:
    """Every method × strategy × budget; a per-strategy summary averaged over budgets.
    ``rows``: see :func:`pairs`."""
    from duetime.sim.profiles import load_profile

    check_budgets(budgets)
    t0 = time.perf_counter()
    cost, cfg = load_profile(profile)
    lengths = pairs(jobs, seed, with_text=predictor.startswith("learned"), rows=rows)
    bs = list(budgets) if budgets else scaled_budgets(cost)
    runs = [
        run_one(m, o, b, lengths, cost, cfg, predictor, seed, tasks)
        for o in STRATEGIES
        for m in methods
        for b in bs
    ]
    summary = summarize(runs, STRATEGIES, methods, ("completion_rate", "mean_alpha"))
    p = np.array([x for x, _, _ in lengths])
    out = np.array([y for _, y, _ in lengths])
    return {
        "profile": profile,
        "predictor": predictor,
        "seed": seed,
        "tasks": tasks,
        "n_max_tokens": N_MAX,
        "k": 5.0,
        "alpha_max": 0.95,
        "budget_scale": (cost.c0 + cost.b) / PAPER_STEP_S,
        "budgets_s": bs,
        "workload": {
            "rows": rows,
            "jobs": len(lengths),
            "prompt_tokens_mean": float(p.mean()),
            "prompt_tokens_max": int(p.max()),
            "output_tokens_mean": float(out.mean()),
            "output_tokens_p90": float(np.percentile(out, 90)),
        },
        "rows": runs,
        "summary": summary,
        "paper": PAPER,
        "wall_s": time.perf_counter() - t0,
    }


def table(fig: dict[str, Any]) -> list[Any]:
    """One table per overrun strategy: completion rate % per method and budget, mean α %."""
    from rich.table import Table

    bs = fig["budgets_s"]
    tables = []
    for o in STRATEGIES:
        t = Table(
            title=f"{o}: completion rate % ({fig['profile']}, predictor {fig['predictor']})",
            caption=f"budgets T in s = the paper's 5-10 s x {fig['budget_scale']:.3f}; "
            "α: mean eviction ratio %",
        )
        t.add_column("method", no_wrap=True)
        for b in bs:
            t.add_column(f"{b:.2f}", justify="right", no_wrap=True)
        t.add_column("mean", justify="right", no_wrap=True)
        t.add_column("α", justify="right", no_wrap=True)
        for m, s in fig["summary"][o].items():
            cells = [
                f"{100 * r['completion_rate']:.1f}"
                for b in bs
                for r in fig["rows"]
                if r["overrun"] == o and r["method"] == m and r["budget_s"] == b
            ]
            t.add_row(
                m,
                *cells,
                f"{100 * s['completion_rate_mean']:.1f}",
                f"{100 * s['mean_alpha_mean']:.0f}",
            )
        tables.append(t)
    return tables


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    """Completion rate and mean α vs budget, one line per method, one column per strategy."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    f = Figure(figsize=(10.0, 7.0))
    for col, o in enumerate(STRATEGIES):
        top = f.add_subplot(2, 2, col + 1)
        bot = f.add_subplot(2, 2, col + 3)
        for m in fig["summary"][o]:
            rs = sorted(
                (r for r in fig["rows"] if r["overrun"] == o and r["method"] == m),
                key=lambda r: r["budget_s"],
            )
            xs = [r["budget_s"] for r in rs]
            style = "-" if m.startswith("timebill") else "--"
            top.plot(xs, [100 * r["completion_rate"] for r in rs], style, marker="o", label=m)
            bot.plot(xs, [100 * r["mean_alpha"] for r in rs], style, marker="o", label=m)
        top.set_title(f"{o}", fontsize=10)
        top.set_ylabel("completion rate (%)")
        bot.set_ylabel("mean KV eviction ratio α (%)")
        bot.set_xlabel("time budget T (s)")
        top.legend(fontsize=7)
    return save_titled_png(
        f,
        path,
        f"TimeBill vs baselines (simulated, {fig['profile']}, predictor {fig['predictor']})",
    )
