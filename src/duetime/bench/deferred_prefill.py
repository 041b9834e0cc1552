"""`duetime bench deferred-prefill`: throughput vs the departure threshold K.

Three curves, as in Mohanty et al. (EuroMLSys 2025), Sec. 5:

- ``analytic``: ρ(K) of Theorem 1 (exact Markov-chain moments) and of
  Proposition 1, with parameters read off a step-cost profile
  (:meth:`DeferredPrefillModel.from_cost`);
- ``sim-model``: the simulator on the paper's own model (prompts of ``d₀``
  tokens, geometric decode lengths, step costs ``c_p + (t_p·d₀/N)·m`` and
  ``c_d + t_d·X``): it must agree with Theorem 1;
- ``sim-sharegpt``: the simulator on ShareGPT lengths with the full profile
  (KV-dependent decode steps, quadratic prefill attention, uneven prompts).

The queue is backlogged (every request waits at t = 0) and the batch holds
``C`` requests; throughput is counted between the first and the last prefill
(whole renewal cycles). The real-engine curve (``--engine``) is in
:mod:`duetime.bench.deferred_prefill_engine`; it reports through
:func:`window_metrics` and :func:`curve_summary` and is drawn by :func:`plot`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from duetime.analysis.deferred_prefill import DeferredPrefillModel, advise
from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request
from duetime.process_pool import process_pool

UNLIMITED = 1 << 40
CURVE_STYLES = {  # curve name → (marker, legend label)
    "sim-model": ("o", "simulated, paper's model"),
    "sim-sharegpt": ("s", "simulated, ShareGPT"),
    "sim-engine": ("o", "simulated, same jobs, fitted engine costs"),
    "real": ("D", "real engine"),
}
K_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192)


def geometric_jobs(n: int, alpha: float, prompt_len: int, seed: int) -> list[Job]:
    """The paper's requests: ``prompt_len`` tokens, 1 + Geometric(α) output tokens.

    The geometric draws are stratified (one per ``1/n`` quantile band, in
    random order) so their mean is ``1/α`` to well under 1 %: with plain
    draws, 2,000 requests miss it by ±2 %, and throughput with them.
    """
    rng = np.random.default_rng([seed, 7])
    u = (rng.permutation(n) + rng.random(n)) / n
    decode = np.maximum(1, np.ceil(np.log1p(-u) / np.log1p(-alpha))).astype(np.int64)
    return [
        Job(Request(rid=i, arrival=0.0, prompt_len=prompt_len, max_tokens=int(g) + 1), int(g) + 1)
        for i, g in enumerate(decode)
    ]


def sharegpt_jobs(n: int, seed: int) -> list[Job]:
    from duetime import workloads as wl

    return wl.build_jobs(n, arrivals=wl.AllAtOnce(), seed=seed)


def measure(jobs: list[Job], cost: LinearStepCost, capacity: int, k: int) -> dict[str, float]:
    """Simulate policy K with a backlogged queue; throughput and completion times."""
    from duetime.policies import make_policy
    from duetime.sim import SimConfig, Simulator

    cfg = SimConfig(kv_capacity=UNLIMITED, max_num_seqs=capacity, max_batch_tokens=UNLIMITED)
    res = Simulator(make_policy("deferred-prefill", k=k), cost, cfg).run(jobs)
    recs = res.records
    # Prefill start = the first token's time minus its (decode-free) prefill step.
    phase: dict[float, list[int]] = defaultdict(list)
    for r in recs:
        phase[float(r.first_token or 0.0)].append(r.request.prompt_len)
    step = {
        t: cost.step_time(sum(ps), sum(cost.chunk_attention(p, p) for p in ps), 0, 0)
        for t, ps in phase.items()
    }
    return {**window_metrics(recs, step, k), "wall_s": res.wall_s}


def window_metrics(recs: list[Any], prefill_step_s: dict[float, float], k: int) -> dict[str, Any]:
    """Throughput over whole renewal cycles and completion times, from finished records.

    ``prefill_step_s`` maps the end of each prefill phase (a first-token time)
    to that phase's duration, so a request's completion time is counted from
    the start of its prefill (the paper's "prompt completion time": queueing
    excluded). The simulator and the real engine both report through here.
    """
    first_at = [float(r.first_token or 0.0) for r in recs]  # every request finished
    first = np.array(first_at)
    finish = np.array([r.finish for r in recs])
    out = np.array([r.output_tokens for r in recs], dtype=float)
    start = first - np.array([prefill_step_s[t] for t in first_at])
    t0, t1 = first.min(), first.max()  # both end a prefill phase: whole renewal cycles between
    win = (finish > t0) & (finish <= t1)
    completion = finish - start
    return {
        "k": k,
        "throughput_req_s": float(win.sum() / (t1 - t0)),
        "throughput_tok_s": float(out[win].sum() / (t1 - t0)),
        "completion_mean_s": float(completion.mean()),
        "completion_p95_s": float(np.percentile(completion, 95)),
        "completion_per_token_s": float((completion / out).mean()),
    }


def curve_summary(
    rows: dict[int, dict[str, Any]], adv: dict[str, Any], exact: dict[Any, float]
) -> dict[str, Any]:
    """Best K, and throughput / completion-time change vs K = 1, of one measured curve."""
    best = max(rows.values(), key=lambda r: r["throughput_req_s"])
    base = rows[1]
    out: dict[str, Any] = {
        "k_best": best["k"],
        "throughput_best_req_s": best["throughput_req_s"],
        "throughput_k1_req_s": base["throughput_req_s"],
        "gain_best_vs_k1_pct": 100 * (best["throughput_req_s"] / base["throughput_req_s"] - 1),
        "completion_change_best_vs_k1_pct": 100
        * (best["completion_mean_s"] / base["completion_mean_s"] - 1),
        "analytic_k_star_throughput_vs_best_pct": 100
        * (adv["throughput_k_star_req_s"] / best["throughput_req_s"] - 1),
        "max_abs_error_vs_theorem1_pct": max(
            abs(100 * (r["throughput_req_s"] / exact[k] - 1)) for k, r in rows.items()
        ),
    }
    at_star = rows.get(adv["k_star"])
    if at_star is not None:
        out["gain_k_star_vs_k1_pct"] = 100 * (
            at_star["throughput_req_s"] / base["throughput_req_s"] - 1
        )
        out["completion_change_k_star_vs_k1_pct"] = 100 * (
            at_star["completion_mean_s"] / base["completion_mean_s"] - 1
        )
    return out


def _task(args: tuple[str, int, int, int, dict[str, Any]]) -> dict[str, Any]:
    kind, k, n, seed, p = args
    if kind == "sim-model":
        model = DeferredPrefillModel(**p["model"])
        jobs = geometric_jobs(n, model.alpha, p["prompt_len"], seed)
        cost = model.to_cost(p["prompt_len"])
    else:
        from duetime.sim.profiles import load_profile

        jobs = sharegpt_jobs(n, seed)
        cost = load_profile(p["profile"])[0]
    return {"curve": kind, **measure(jobs, cost, p["model"]["capacity"], k)}


def run(
    requests: int = 2000,
    capacity: int = 256,
    profile: str = "a100-llama2-7b",
    seed: int = 0,
    workers: int = 2,
    ks: tuple[int, ...] = K_GRID,
) -> dict[str, Any]:
    """Analytic and simulated throughput over K; figures named with their units."""
    from duetime.sim.profiles import load_profile

    if requests < 2 * capacity:  # as the real-engine curve: else t1 == t0 and 0/0 throughput
        raise ValueError(
            f"--requests {requests} is too few for C = {capacity}: need >= {2 * capacity} so "
            "that whole refill cycles fit between the first and the last prefill"
        )
    t_start = time.perf_counter()
    cost = load_profile(profile)[0]
    share = sharegpt_jobs(requests, seed)
    mean_out = float(np.mean([j.output_len for j in share]))
    d0 = round(float(np.mean([j.request.prompt_len for j in share])))
    model = DeferredPrefillModel.from_cost(cost, capacity, mean_out, d0)
    adv = advise(model)
    grid = sorted({k for k in ks if k <= capacity} | {adv["k_star"], adv["k_star_approx"]})
    params = {"model": model.to_dict(), "prompt_len": d0, "profile": profile}
    tasks = [
        (kind, k, requests, seed, params) for kind in ("sim-model", "sim-sharegpt") for k in grid
    ]
    tasks.sort(key=lambda t: t[1])  # K = 1 is the slowest (a prefill after every departure)
    with process_pool(workers) as pool:
        sims = list(pool.map(_task, tasks))
    analytic = [
        {
            "k": k,
            "throughput_req_s": model.throughput(k),
            "throughput_approx_req_s": model.throughput_approx(k),
        }
        for k in range(1, capacity + 1)
    ]
    by = {c: {r["k"]: r for r in sims if r["curve"] == c} for c in ("sim-model", "sim-sharegpt")}
    exact = {r["k"]: r["throughput_req_s"] for r in analytic}
    summary = {c: curve_summary(rows, adv, exact) for c, rows in by.items()}
    return {
        "profile": profile,
        "capacity": capacity,
        "requests": requests,
        "seed": seed,
        "workload": {
            "sharegpt_output_tokens_mean": mean_out,
            "sharegpt_prompt_tokens_mean": d0,
        },
        "advice": adv,
        "summary": summary,
        "analytic": analytic,
        "simulated": sims,
        "real": None,  # `--engine`: duetime.bench.deferred_prefill_engine
        "wall_s": time.perf_counter() - t_start,
    }


def plot(fig: dict[str, Any], path: str | Path) -> Path:
    """Throughput vs K (analytic, approximation, simulated) and completion time vs K."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_titled_png

    f = Figure(figsize=(11, 4.2))
    ax = f.add_subplot(1, 2, 1)
    an = fig["analytic"]
    ks = [r["k"] for r in an]
    ax.plot(ks, [r["throughput_req_s"] for r in an], "k-", label="analytic ρ(K), Theorem 1")
    approx = [(r["k"], r["throughput_approx_req_s"]) for r in an if r["throughput_approx_req_s"]]
    ax.plot(*zip(*approx, strict=True), "k--", lw=0.9, label="approximation, Prop. 1")
    ax2 = f.add_subplot(1, 2, 2)
    measured = [*fig["simulated"], *[{**r, "curve": "real"} for r in fig.get("real") or ()]]
    for curve, (marker, label) in CURVE_STYLES.items():
        rows = sorted((r for r in measured if r["curve"] == curve), key=lambda r: r["k"])
        if not rows:
            continue
        x = [r["k"] for r in rows]
        (line,) = ax.plot(x, [r["throughput_req_s"] for r in rows], marker, ms=5, label=label)
        ax2.plot(x, [r["completion_mean_s"] for r in rows], marker + "-", ms=5, label=label)
        for r in rows:  # repetitions of a real run (--reps): their spread around the median
            reps = r.get("throughput_reps_req_s") or []
            if len(reps) > 1:
                ax.plot([r["k"]] * len(reps), reps, "_", ms=9, color=line.get_color(), alpha=0.6)
    adv = fig["advice"]
    ax.axvline(adv["k_star"], color="grey", lw=0.8, ls=":", label=f"K* = {adv['k_star']}")
    ax.set_xscale("log")
    ax.set_xlabel("departure threshold K")
    ax.set_ylabel("throughput (requests/s)")
    real = "real engine measured" if fig.get("real") else "real engine: not run (--engine)"
    ax.set_title(f"C = {fig['capacity']}, profile {fig['profile']} ({real})", fontsize=9)
    ax.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_xlabel("departure threshold K")
    ax2.set_ylabel("mean completion time, prefill to last token (s)")
    ax2.legend(fontsize=7)
    return save_titled_png(f, path, "Deferred prefill: throughput and completion time vs K")


def table(fig: dict[str, Any]) -> Any:
    """A rich table: throughput per K, analytic and simulated."""
    from rich.table import Table

    exact = {r["k"]: r for r in fig["analytic"]}
    sims = {(r["curve"], r["k"]): r for r in fig["simulated"]}
    t = Table(title=f"deferred prefill, C = {fig['capacity']}, profile {fig['profile']}")
    t.caption = "requests/s; tok/s and completion (prefill to last token): ShareGPT run"
    for col in ("K", "Theorem 1", "Prop. 1", "sim model", "sim ShareGPT", "tok/s",
                "completion s"):  # fmt: skip
        t.add_column(col, justify="right", no_wrap=True)
    for k in sorted({k for _, k in sims}):
        m, s = sims[("sim-model", k)], sims[("sim-sharegpt", k)]
        t.add_row(
            str(k),
            f"{exact[k]['throughput_req_s']:.3f}",
            f"{exact[k]['throughput_approx_req_s']:.3f}" if k < fig["capacity"] else "n/a",
            f"{m['throughput_req_s']:.3f}",
            f"{s['throughput_req_s']:.3f}",
            f"{s['throughput_tok_s']:,.0f}",
            f"{s['completion_mean_s']:.2f}",
        )
    return t
