"""What automatic prefix caching buys on the engine: time to first token with a shared prompt.

``duetime bench prefix-cache``. The workload is the one prefix caching is for:
``n`` requests that share a system prompt of ``system_len`` tokens (a robot's
instructions, an agent's tool list, a document asked about) and differ in a
short question. They are served one at a time (each arrives after the previous
one is done), once with the cache off and once with it on, on the same model
in the same process, so the TTFT ratio is side by side; the runs are interleaved
(off, on, off, on, ...) so the machine's drift falls on both, and the figures are
medians over the repeats. The first request of the cached run fills the cache;
the figures are over the others.

Both runs are greedy, and the cached run must produce the same answers:
``answers_identical`` counts those that do (a copied key differs from a
recomputed one by float rounding at most, which can flip a near-tie).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from duetime.bench.engine_fit import LATENCY_KEYS, latency_figures, warm_up
from duetime.core.request import Job, Request
from duetime.engine.executor import EngineExecutor
from duetime.policies import make_policy

__all__ = ["TABLE_KEYS", "run", "table_columns"]

_GAP_S = 1e6  # arrivals so far apart that each request runs alone (skip_idle jumps the wait)


def _jobs(system: Sequence[int], questions: Sequence[Sequence[int]], new_tokens: int) -> list[Job]:
    jobs = []
    for i, q in enumerate(questions):
        ids = tuple(system) + tuple(q)
        req = Request(
            rid=i,
            arrival=_GAP_S * i,
            prompt_len=len(ids),
            prompt_token_ids=ids,
            max_tokens=new_tokens,
        )
        jobs.append(Job(req, new_tokens))
    return jobs


def _serve(model: Any, jobs: list[Job], cache_tokens: int) -> tuple[EngineExecutor, Any, float]:
    ex = EngineExecutor(
        make_policy("fcfs"),
        model,
        kv_capacity=max(j.request.prompt_len for j in jobs) + 64,
        max_batch_tokens=2048,
        prefix_cache_tokens=cache_tokens,
        skip_idle=True,
    )
    t = time.perf_counter()
    res = ex.run(jobs)
    return ex, res, time.perf_counter() - t


def run(
    model: Any,
    system: Sequence[int],
    questions: Sequence[Sequence[int]],
    *,
    new_tokens: int = 16,
    cache_tokens: int = 4096,
    repeats: int = 3,
) -> dict[str, Any]:
    """Serve the same requests without and with the prefix cache, ``repeats`` times
    interleaved; the medians, JSON-ready."""
    if len(questions) < 2:
        raise ValueError("need at least 2 questions: the first one fills the cache")
    if cache_tokens < len(system):
        raise ValueError(
            f"a cache of {cache_tokens} tokens cannot hold the {len(system)}-token shared prompt"
        )
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    warm_up(model)  # first-call costs (allocator, kernels) land in neither run
    budgets = {"plain": 0, "cached": cache_tokens}  # the two runs' prefix cache budgets
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in budgets}
    outputs = {}
    for _ in range(repeats):
        for label, budget in budgets.items():
            ex, res, wall = _serve(model, _jobs(system, questions, new_tokens), budget)
            runs[label].append(
                {
                    **latency_figures(res.records[1:]),
                    "prefill_tokens": ex.prefill_tokens,
                    "cached_tokens": ex.prefill_cached_tokens,
                    "cache_nbytes": ex.prefix_cache.nbytes if ex.prefix_cache else 0,
                    "wall_s": wall,
                }
            )
            outputs[label] = res.outputs
    plain, cached = (
        {k: statistics.median(r[k] for r in runs[label]) for k in runs[label][0]}
        for label in budgets
    )
    prompt_tokens = sum(len(system) + len(q) for q in questions[1:])
    same = sum(outputs["plain"][i] == outputs["cached"][i] for i in range(len(questions)))
    return {
        "requests": len(questions),
        "system_tokens": len(system),
        "question_tokens_mean": statistics.fmean(len(q) for q in questions),
        "new_tokens": new_tokens,
        "cache_tokens": cache_tokens,
        "repeats": repeats,
        "plain": plain,
        "cached": cached,
        "ttft_speedup": plain["ttft_p50_s"] / cached["ttft_p50_s"],
        "e2e_speedup": plain["e2e_mean_s"] / cached["e2e_mean_s"],
        "hit_rate_pct": 100.0 * cached["cached_tokens"] / prompt_tokens,
        "answers_identical": same,
    }


TABLE_KEYS = (
    *LATENCY_KEYS,
    "prefill_tokens",
    "cached_tokens",
    "cache_nbytes",
    "wall_s",
)


def table_columns(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The two runs as ``render_table`` columns (rows: :data:`TABLE_KEYS`)."""
    return {"cache off": fig["plain"], "cache on": fig["cached"]}
