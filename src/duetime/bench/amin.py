"""`duetime bench amin`: the experiments of Chen, Ye, Zhou (2025), Sec. 6, on ShareGPT.

2,000 ShareGPT conversations (the paper samples 2,000 from LMSYS-Chat-1M,
which is not available offline), all waiting at time 0, outputs capped at
1,000 tokens so that the paper's intervals hold the truth. Each interval
construction (:mod:`duetime.predict.intervals`) is run through Amax and Amin;
H-SF runs on the true lengths. We report the total end-to-end latency (TEL,
the sum of completion times) and its ratio to H-SF's, in two settings:

- ``unit``: the paper's model exactly (:mod:`duetime.analysis.amin_model`):
  one time unit per batch, memory ``M`` tokens, no other limit;
- ``linear``: the paper's experimental setting, batch time from a linear
  step-cost model (our shipped profile; the paper used Vidur's predictor for
  LLaMA2-70B on two A100s), the same memory ``M``.

A second set runs Amax and Amin on the intervals of duetime's trained
length predictor (``learned``: 90 % conformal intervals from the prompt
alone, which miss the truth about one time in ten, where the paper's hold it
by construction), on the ShareGPT rows that predictor never trained on
(``heldout_rows``), beside H-SF on the same rows. A third, small experiment
checks A_ℓ on two-point lengths against Theorems 6–7. Runs go to a process
pool.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.request import Job
from duetime.process_pool import process_pool

CONSTRUCTIONS: dict[str, str] = {
    "rough": "interval:rough",
    "bins10": "interval:bins10",
    "overlap-0.1": "interval:overlap:0.1",
    "overlap-0.95": "interval:overlap:0.95",
    "overlap-0.99": "interval:overlap:0.99",
}
LEARNED = "learned"  # the trained length predictor's intervals, on held-out rows


def is_learned(construction: str) -> bool:
    """Whether ``construction`` is a trained predictor's (``learned``, ``learned:minilm-ft``,
    ``learned:<model file>``): judged on held-out rows, beside H-SF on the same rows."""
    return construction == LEARNED or construction.startswith(LEARNED + ":")


def check_learned(specs: Sequence[str]) -> None:
    """Refuse a spec that is not a trained predictor's, or names no shipped model or file,
    before any run starts."""
    from duetime.predict.length_fit import SHIPPED_MODELS

    for spec in specs:
        if not is_learned(spec):
            raise ValueError(f"--learned: {spec!r} is not learned, learned:<shipped model> or "
                             "learned:<model file>")  # fmt: skip
        arg = spec.partition(":")[2]
        if arg and arg not in SHIPPED_MODELS and not Path(arg).is_file():
            raise ValueError(f"--learned: {spec!r} names neither a shipped model "
                             f"({', '.join(SHIPPED_MODELS)}) nor a model file")  # fmt: skip


SETTINGS = ("unit", "linear")
MAX_OUTPUT = 1000  # the paper's intervals end at 1,000 tokens
TWO_POINT_ELL = 20
TWO_POINT_U = (30, 40, 80, 200)  # α = 2/3, 1/2, 1/4, 1/10
TWO_POINT_JOBS = 600
TWO_POINT_MEMORY = 2048


def sharegpt_jobs(requests: int, seed: int) -> list[Job]:
    """ShareGPT pairs, all arriving at 0, outputs <= 1,000 and prompt + output <= 4,096 tokens."""
    from duetime import workloads as wl

    caps = wl.LengthCaps(max_output_len=MAX_OUTPUT, max_total_len=4096)
    return wl.build_jobs(requests, arrivals=wl.AllAtOnce(), seed=seed, caps=caps)


def heldout_jobs(requests: int, seed: int) -> list[Job]:
    """As :func:`sharegpt_jobs`, with prompt text, from the rows no shipped length predictor
    trained on; at most as many requests as there are such rows (no row twice)."""
    from duetime import workloads as wl
    from duetime.predict.length_data import heldout_pool

    lengths = wl.load_sharegpt_lengths(progress=False)
    caps = wl.LengthCaps(max_output_len=MAX_OUTPUT, max_total_len=4096)
    pool = heldout_pool(lengths, caps)
    return wl.build_jobs(
        min(requests, len(pool)),
        source=wl.ShareGPTSource(lengths, pool=pool),
        arrivals=wl.AllAtOnce(),
        seed=seed,
        caps=caps,
        with_prompt_text=True,
    )


def _jobs_for(construction: str, requests: int, seed: int) -> list[Job]:
    if is_learned(construction):
        return heldout_jobs(requests, seed)
    return sharegpt_jobs(requests, seed)


def interval_stats(jobs: list[Job], predictor: str = LEARNED) -> dict[str, float]:
    """How the predictor's intervals sit on ``jobs``: the share holding the truth, the
    mean width and the median α = lo / hi (the Amin paper's ratio; its bounds assume
    the truth inside)."""
    from duetime.predict.oracle import make_job_predictor

    pred = make_job_predictor(predictor)
    assert pred is not None
    p = [pred.predict_job(j) for j in jobs]
    o = np.array([j.output_len for j in jobs], dtype=float)
    lo, hi = np.array([x.lo for x in p]), np.array([x.hi for x in p])
    return {
        "requests": len(jobs),
        "coverage": float(np.mean((lo <= o) & (o <= hi))),
        "below_lo_share": float(np.mean(o < lo)),
        "interval_width_mean_tokens": float(np.mean(hi - lo)),
        "alpha_median": float(np.median(np.maximum(lo, 1.0) / np.maximum(hi, 1.0))),
    }


def _fresh(jobs: list[Job]) -> list[Job]:
    """Copies without predictions (the simulator annotates requests in place)."""
    return [
        dataclasses.replace(j, request=dataclasses.replace(j.request, predicted=None)) for j in jobs
    ]


def _setup(setting: str, kv_capacity: int, profile: str) -> tuple[Any, Any]:
    from duetime.analysis.amin_model import exact_config, unit_cost
    from duetime.sim.profiles import load_profile

    cost = unit_cost() if setting == "unit" else load_profile(profile)[0]
    return cost, exact_config(kv_capacity)


def _simulate(jobs: list[Job], policy: str, predictor: str, cost: Any, cfg: Any, seed: int) -> Any:
    from duetime.policies import make_policy
    from duetime.predict.oracle import make_job_predictor
    from duetime.sim import Simulator

    pol = make_policy(policy, seed=seed)
    return Simulator(pol, cost, cfg, make_job_predictor(predictor, seed=seed)).run(_fresh(jobs))


def _row(res: Any, **labels: Any) -> dict[str, Any]:
    recs = res.records
    done = [r for r in recs if r.completed]
    tel = float(sum(r.e2e for r in done))
    return {
        **labels,
        "requests": len(recs),
        "completed": len(done),
        "tel_s": tel,
        "mean_latency_s": tel / max(len(done), 1),
        "makespan_s": res.sim_time,
        "restarts": res.counters.get("restarts", 0),
        "engine_steps": res.engine_steps,
        "kv_peak_tokens": res.kv_peak,
        "wall_s": res.wall_s,
    }


def run_sharegpt(task: tuple[str, str, str, str, int, int, int, str]) -> dict[str, Any]:
    """One (setting, policy, construction) run; a process-pool task."""
    setting, policy, construction, predictor, requests, seed, kv_capacity, profile = task
    cost, cfg = _setup(setting, kv_capacity, profile)
    jobs = _jobs_for(construction, requests, seed)
    res = _simulate(jobs, policy, predictor, cost, cfg, seed)
    return _row(res, setting=setting, policy=policy, construction=construction)


def run_two_point(task: tuple[int, int, float, int, int, int]) -> list[dict[str, Any]]:
    """H-SF, Amin, A_ℓ and Amax on lengths ℓ or u (prompt size s = 0), unit-time model."""
    from duetime.analysis.amin_model import (
        aell_bound,
        amin_two_point_bound,
        exact_config,
        paper_jobs,
        unit_cost,
    )

    ell, u, short_share, n, memory, seed = task
    rng = np.random.default_rng([seed, u])
    outs = np.where(rng.random(n) < short_share, ell, u)
    jobs = paper_jobs(outs.tolist(), s=0)
    alpha = ell / u
    rows = []
    for policy, pred in (
        ("hsf", "oracle"),
        ("amin", f"interval:rough:{ell}:{u}"),
        ("aell", f"interval:rough:{ell}:{u}"),
        ("amax", f"interval:rough:{ell}:{u}"),
    ):
        res = _simulate(jobs, policy, pred, unit_cost(), exact_config(memory), seed)
        rows.append(_row(res, policy=policy, ell=ell, u=u, alpha=alpha, short_share=short_share))
    hsf = rows[0]["tel_s"]
    for r in rows:
        r["tel_ratio_vs_hsf"] = r["tel_s"] / hsf
        r["bound_amin"] = amin_two_point_bound(alpha)
        r["bound_aell"] = aell_bound(alpha)
    return rows


def run(
    requests: int = 2000,
    seed: int = 0,
    kv_capacity: int = 111_000,
    profile: str = "a100-llama2-7b",
    workers: int = 2,
    two_point: bool = True,
    learned: Sequence[str] = (LEARNED,),
) -> dict[str, Any]:
    """All runs; returns figures named with their units. ``learned``: the trained
    predictors whose intervals also run (each its own construction, named by its spec)."""
    t0 = time.perf_counter()
    learned = list(dict.fromkeys(learned))
    check_learned(learned)
    # before any run: a memory no request fits completed none, and H-SF's TEL of 0 was a
    # ZeroDivisionError in the ratios
    jobs = sharegpt_jobs(requests, seed)  # also the workload the figures describe
    need = max(j.request.prompt_len + j.output_len for j in jobs)
    if need > kv_capacity:
        raise ValueError(f"--kv-capacity {kv_capacity}: a request needs {need} tokens at its peak")
    constructions = {**CONSTRUCTIONS, **{spec: spec for spec in learned}}
    tasks = [(s, "hsf", "oracle", "oracle", requests, seed, kv_capacity, profile) for s in SETTINGS]
    if learned:  # H-SF again on the rows the learned intervals are judged on (named "learned")
        tasks += [
            (s, "hsf", LEARNED, "oracle", requests, seed, kv_capacity, profile) for s in SETTINGS
        ]
    tasks += [
        (s, p, name, spec, requests, seed, kv_capacity, profile)
        for s in SETTINGS
        for name, spec in constructions.items()
        for p in ("amax", "amin")
    ]
    tp_tasks = [
        (TWO_POINT_ELL, u, 0.5, TWO_POINT_JOBS, TWO_POINT_MEMORY, seed) for u in TWO_POINT_U
    ]
    if not two_point:
        tp_tasks = []
    # Longest first (Amin), so the pool's two workers finish together.
    order = sorted(range(len(tasks)), key=lambda i: tasks[i][1] != "amin")
    with process_pool(workers) as pool:
        tp_futs = [pool.submit(run_two_point, t) for t in tp_tasks]
        futs = {i: pool.submit(run_sharegpt, tasks[i]) for i in order}
        rows = [futs[i].result() for i in range(len(tasks))]
        tp_rows = [r for f in tp_futs for r in f.result()]

    def jobs_of(construction: str) -> str:
        return "heldout" if is_learned(construction) else "all"

    hsf = {
        (r["setting"], jobs_of(r["construction"])): r["tel_s"] for r in rows if r["policy"] == "hsf"
    }
    for r in rows:
        base = hsf[(r["setting"], jobs_of(r["construction"]))]
        r["tel_ratio_vs_hsf"] = r["tel_s"] / base if base else None  # H-SF finished none
    p = np.array([j.request.prompt_len for j in jobs])
    o = np.array([j.output_len for j in jobs])
    return {
        "workload": {
            "source": "ShareGPT (first human/gpt turn pair), all arriving at t = 0",
            "requests": requests,
            "seed": seed,
            "prompt_tokens_mean": float(p.mean()),
            "prompt_tokens_median": float(np.median(p)),
            "output_tokens_mean": float(o.mean()),
            "output_tokens_median": float(np.median(o)),
            "output_tokens_max": int(o.max()),
        },
        "kv_capacity_tokens": kv_capacity,
        "profile": profile,
        "settings": {
            "unit": "1 time unit (1 s) per batch; the paper's model",
            "linear": f"step time from profile {profile}; the paper's experimental setting",
        },
        "rows": rows,
        "learned_predictors": learned,
        # how each trained predictor's intervals sit on the held-out rows
        "learned_intervals": {
            spec: interval_stats(heldout_jobs(requests, seed), spec) for spec in learned
        },
        "two_point": tp_rows,
        "wall_s": time.perf_counter() - t0,
    }
