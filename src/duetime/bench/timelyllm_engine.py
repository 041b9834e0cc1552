"""`duetime bench timelyllm --engine`: the five systems on the real engine, at small scale.

The simulated benchmark (:mod:`duetime.bench.timelyllm`) models the paper's
RTX 4090. Here the same LRTrace tasks run through the real executor on
Gemma 3 270M on this CPU, after one scaling step so that the robot's world
is as long, relative to generation, as in the paper:

- ``time_x`` = this engine's batch-1 decode step / the paper's (21.5 ms).
  Every time of the trace is multiplied by it: arrivals, robot action times
  (``segment_gaps``), ERTs; TUF slopes α are divided by it, so the utility of
  a response at ``time_x · t`` here equals the paper's at ``t``.
- ``prompt_x``: prompts shrink so that prefilling one takes ``time_x`` times
  as long as on the paper's GPU (our prefill is far slower than our decode
  relative to a GPU's). Segment lengths in tokens are kept.

Both factors come from a short calibration (:func:`calibrate`: a few dozen
timed steps, fitted to a :class:`LinearStepCost`), which is also the cost
model the policies see (``snap.cost``) and the simulator runs on the same
scaled jobs for comparison. Segment boundaries are the trace's token counts
(end-of-sequence ignored, as vLLM's serving benchmark does): a base model's
text holds no robot actions (the text stop checkers are
:mod:`duetime.engine.segment_stop`).

While the engine has nothing to run (every task is waiting for its robot),
the clock jumps to the next arrival or ready time instead of sleeping
(``EngineExecutor(skip_idle=True)``): every step is still timed on the wall clock, and a run
takes its compute time, not the trace's length.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetime.bench.timelyllm import (
    _POLICY,
    BASELINE,
    SYSTEMS,
    _unsegmented,
    add_gains,
    paper_rtx4090,
    score,
)
from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, TimeUtility

PAPER_PROMPT = 350  # the middle of LRTrace's 200-500 token prompts


@dataclass(frozen=True, slots=True)
class EngineScale:
    """How the paper's trace is stretched to this engine (see the module docstring)."""

    time_x: float
    prompt_x: float
    decode_step_s: float  # fitted batch-1 decode step at 64 KV tokens
    prefill_scaled_prompt_s: float  # fitted prefill of prompt_x · 350 tokens


def calibrate(model: Any, reps: int = 2) -> tuple[LinearStepCost, EngineScale]:
    """Time a small grid of steps, fit the step cost, derive the two scale factors."""
    from duetime.engine.cost_regimes import regimes_of
    from duetime.engine.profile import ProfileGrid, measure_steps
    from duetime.predict.ete import fit_batch_cost

    grid = ProfileGrid(
        prompt_lens=(8, 16, 32, 64),
        batches=(1, 2, 4, 8),
        contexts=(32, 96),
        mixed=((16, 2, 32), (32, 4, 64)),
        reps=reps,
        max_setup_tokens=1024,
    )
    cost = fit_batch_cost(
        measure_steps(model, grid), name="engine-calibrated", regimes=regimes_of(model)
    )
    return cost, scale_for(cost)


def scale_for(cost: LinearStepCost) -> EngineScale:
    """The two scale factors of an engine whose steps cost ``cost``."""
    paper, _ = paper_rtx4090()
    step = cost.step_time(0, 0.0, 1, 64)
    time_x = step / paper.step_time(0, 0.0, 1, 64)
    target = time_x * paper.prefill_time(PAPER_PROMPT)
    n = _tokens_within(cost.prefill_time, target, PAPER_PROMPT)
    return EngineScale(time_x, n / PAPER_PROMPT, step, cost.prefill_time(n))


def calibration_from_profile(profile: str) -> tuple[LinearStepCost, EngineScale]:
    """A step-cost profile (a `duetime profile` JSON or a shipped name) instead of timing."""
    from duetime.bench.engine_fit import read_profile

    cost, _ = read_profile(profile)
    return cost, scale_for(cost)


def _scaled_prompt_len(prompt_len: int, scale: EngineScale | None) -> int:
    """A task's prompt on the engine; without a scale yet, the shortest it can be (2)."""
    return 2 if scale is None else max(2, round(prompt_len * scale.prompt_x))


def check_fits(
    wids: tuple[int, ...], requests: int, seed: int, kv_capacity: int, scale: EngineScale | None
) -> None:
    """Every task must fit ``kv_capacity`` at its peak (its prompt and whole answer).

    A task that cannot never finishes (``--kv-capacity 1`` loaded, calibrated and
    then failed "task 0 did not finish"). Before calibrating (``scale`` None)
    prompts count as their shortest scaled length, so only a sure failure is
    refused then; :func:`run` checks again with the scale.
    """
    from duetime.workloads.lrtrace import lrtrace_jobs

    for w in wids:
        for j in lrtrace_jobs(w, seed=seed)[:requests]:
            p = _scaled_prompt_len(j.request.prompt_len, scale)
            if p + j.output_len > kv_capacity:
                least = "at least " if scale is None else ""
                raise ValueError(
                    f"--kv-capacity {kv_capacity}: task {j.request.rid} of WID{w} needs "
                    f"{least}{p + j.output_len} KV tokens at its peak ({p} prompt + "
                    f"{j.output_len} output) and would never finish"
                )


def calibration_from_json(path: str | Path) -> tuple[LinearStepCost, EngineScale]:
    """The cost and scale an earlier ``--engine --json`` run measured (to compare runs)."""
    import json

    try:
        fig = json.loads(Path(path).read_text())
        sc = fig["scale"]
        cost = LinearStepCost.from_dict(fig["cost"], f"{path}: its cost")
        scale = EngineScale(
            float(sc["time_x"]),
            float(sc["prompt_x"]),
            float(sc["decode_step_s"]),
            float(sc["prefill_scaled_prompt_s"]),
        )
    except FileNotFoundError:
        raise ValueError(f"{path}: calibration file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: not the JSON of `duetime bench timelyllm --engine` ({type(e).__name__}: {e})"
        ) from None
    return cost, scale


def _tokens_within(prefill: Callable[[int], float], target: float, hi: int) -> int:
    """Largest prompt (>= 1 token) whose prefill takes at most ``target`` seconds."""
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefill(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def scaled_jobs(
    wid: int, n: int, seed: int, scale: EngineScale, bos_id: int, vocab: int
) -> list[Job]:
    """The first ``n`` tasks of LRTrace ``wid``, stretched in time and with short prompts."""
    from duetime.core.request import Request
    from duetime.workloads.lrtrace import lrtrace_jobs

    src = lrtrace_jobs(wid, seed=seed)[:n]
    if not src:
        raise ValueError(f"LRTrace WID{wid} with seed {seed} has no tasks")
    t0 = src[0].request.arrival
    rng = np.random.default_rng([seed, wid, 7])
    tx = scale.time_x
    jobs = []
    for j in src:
        r = j.request
        assert r.tuf is not None
        tuf = TimeUtility(ert=r.tuf.ert * tx, beta=r.tuf.beta, alpha=r.tuf.alpha / tx)
        p = _scaled_prompt_len(r.prompt_len, scale)
        ids = (
            bos_id,
            *(int(i) for i in rng.integers(min(1000, vocab // 4), min(vocab, 30_000), p - 1)),
        )
        arrival = (r.arrival - t0) * tx
        req = Request(
            rid=r.rid,
            arrival=arrival,
            prompt_len=p,
            max_tokens=r.max_tokens,
            deadline=arrival + tuf.ert,
            tuf=tuf,
            klass=r.klass,
            prompt_token_ids=ids,
        )
        gaps = tuple(g * tx for g in j.segment_gaps)
        estimates = tuple(g * tx for g in j.segment_gap_estimates)
        jobs.append(Job(req, j.output_len, j.segments, gaps, estimates))
    return jobs


def run_engine_system(
    system: str, jobs: list[Job], model: Any, cost: LinearStepCost, limits: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One system on the engine and, on the same jobs, on the simulator: two rows."""
    from duetime.policies import make_policy
    from duetime.sim import SimConfig, Simulator

    run_jobs = _unsegmented(jobs) if system == "vllm" else jobs
    from duetime.engine.executor import EngineExecutor

    policy = make_policy(_POLICY[system])
    ex = EngineExecutor(policy, model, cost=cost, skip_idle=True, **limits)
    t0 = time.perf_counter()
    res = ex.run(copy.deepcopy(run_jobs))
    wall = time.perf_counter() - t0
    assert ex.kv.total_tokens == 0, "KV left behind"
    row: dict[str, Any] = {
        "system": system,
        "policy": _POLICY[system],
        "tasks": len(jobs),
        **score(system, jobs, res.records),
        "kv_peak_tokens": res.kv_peak,
        "kv_capacity_tokens": limits["kv_capacity"],
        "max_num_seqs": limits["max_num_seqs"],
        "offloads": res.counters.get("offloads", 0),
        "preemptions": res.preemptions,
        "engine_steps": res.engine_steps,
        "policy_calls": res.policy_calls,
        "tokens_generated": res.tokens_generated,
        "span_s": res.wall_s,
        "idle_skipped_s": ex.idle_skipped_s,
        "busy_step_mean_s": (res.wall_s - ex.idle_skipped_s) / max(res.engine_steps, 1),
        "wall_s": wall,
    }
    cfg = SimConfig(
        kv_capacity=limits["kv_capacity"],
        max_num_seqs=limits["max_num_seqs"],
        max_batch_tokens=limits["max_batch_tokens"],
        offload_suspended=limits["offload_suspended"],
    )
    sim = Simulator(make_policy(_POLICY[system]), cost, cfg).run(copy.deepcopy(run_jobs))
    sim_row = {"system": system, **score(system, jobs, sim.records), "span_s": sim.sim_time}
    return row, sim_row


def run(
    model: Any,
    *,
    wids: tuple[int, ...] = (2,),
    requests: int = 16,
    seed: int = 0,
    kv_capacity: int = 8192,
    max_num_seqs: int = 16,
    max_batch_tokens: int = 512,
    offload: bool = True,
    systems: tuple[str, ...] = SYSTEMS,
    calibration: tuple[LinearStepCost, EngineScale] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every system on the engine (and the simulator twin) on scaled LRTrace tasks."""
    if BASELINE not in systems:
        raise ValueError(f"systems must include the baseline {BASELINE!r}")
    t0 = time.perf_counter()
    if calibration is None:  # a sure failure, before the calibration's timed steps
        check_fits(wids, requests, seed, kv_capacity, None)
    cost, scale = calibration if calibration is not None else calibrate(model)
    check_fits(wids, requests, seed, kv_capacity, scale)
    cfg = model.config
    limits = {
        "kv_capacity": kv_capacity,
        "max_num_seqs": max_num_seqs,
        "max_batch_tokens": max_batch_tokens,
        "offload_suspended": offload,
    }
    rows, sim_rows = [], []
    for w in wids:
        jobs = scaled_jobs(w, requests, seed, scale, cfg.bos_token_id, cfg.vocab_size)
        for s in systems:
            if progress is not None:
                progress(f"WID{w} {s}")
            row, sim_row = run_engine_system(s, jobs, model, cost, limits)
            rows.append({"wid": w, **row})
            sim_rows.append({"wid": w, **sim_row})
    summary = add_gains(rows, wids) if "timelyllm" in systems else {}
    sim_summary = add_gains(sim_rows, wids) if "timelyllm" in systems else {}
    return {
        "profile": f"engine {cost.name}",
        "executor": "engine",
        "kv_capacity_tokens": kv_capacity,
        "max_num_seqs": max_num_seqs,
        "max_batch_tokens": max_batch_tokens,
        "offload_suspended": offload,
        "requests": requests,
        "seed": seed,
        "baseline": BASELINE,
        "scale": {
            "time_x": scale.time_x,
            "prompt_x": scale.prompt_x,
            "decode_step_s": scale.decode_step_s,
            "prefill_scaled_prompt_s": scale.prefill_scaled_prompt_s,
        },
        "cost": cost.to_profile(),
        "rows": rows,
        "summary": summary,
        "simulated_same_jobs": {"rows": sim_rows, "summary": sim_summary},
        "wall_s": time.perf_counter() - t0,
    }
