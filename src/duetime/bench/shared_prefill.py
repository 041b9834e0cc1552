"""What shared prefills buy on the engine: time to first token of a burst that starts alike.

``duetime bench shared-prefill``. Two bursts a prefix cache cannot help, since
every request arrives before any block of the common prompt exists:

* ``choices``: ``copies`` requests with one prompt, what a request with ``n`` > 1
  choices (or best-of sampling) hands the engine;
* ``system``: ``requests`` requests behind one system prompt, each with its own
  short question (robots or agents started together).

Each burst is served with shared prefills off and on (the prefix cache on in both,
as a server runs), on the same model in the same process, runs interleaved
(off, on, off, on, ...) so the machine's drift falls on both; the figures are
medians over the repeats. Both runs are greedy and must give the same answers
(``answers_identical``: a borrowed key may differ from a computed one by float
rounding at most).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from duetime.bench.engine_fit import LATENCY_KEYS, burst_jobs, latency_figures, warm_up
from duetime.engine.executor import EngineExecutor
from duetime.policies import make_policy

__all__ = ["TABLE_KEYS", "run", "table_columns"]

MODES = ("plain", "shared")


def _serve(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, share: bool, cache_tokens: int
) -> tuple[dict[str, Any], dict[int, list[int]]]:
    ex = EngineExecutor(
        make_policy("fcfs"),
        model,
        kv_capacity=sum(len(p) + new_tokens for p in prompts) + 64,
        max_num_seqs=max(len(prompts), 1),
        max_batch_tokens=2048,
        prefix_cache_tokens=cache_tokens,
        share_prefills=share,
    )
    t = time.perf_counter()
    res = ex.run(burst_jobs(prompts, new_tokens))
    wall = time.perf_counter() - t
    figs = {
        **latency_figures(res.records),
        "prefill_tokens": ex.prefill_tokens,
        "shared_tokens": ex.prefill_shared_tokens,
        "cached_tokens": ex.prefill_cached_tokens,
        "engine_steps": res.engine_steps,
        "wall_s": wall,
    }
    return figs, res.outputs


def _burst(
    model: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    repeats: int,
    cache_tokens: int,
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    outputs: dict[str, dict[int, list[int]]] = {}
    for _ in range(repeats):
        for mode in MODES:
            figs, outputs[mode] = _serve(model, prompts, new_tokens, mode == "shared", cache_tokens)
            runs[mode].append(figs)
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in MODES}
    plain, shared = med["plain"], med["shared"]
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "plain": plain,
        "shared": shared,
        "ttft_p50_speedup": plain["ttft_p50_s"] / shared["ttft_p50_s"],
        "ttft_max_speedup": plain["ttft_max_s"] / shared["ttft_max_s"],
        "e2e_speedup": plain["e2e_mean_s"] / shared["e2e_mean_s"],
        "prefill_saved_pct": 100.0 * (1 - shared["prefill_tokens"] / plain["prefill_tokens"]),
        "answers_identical": sum(
            outputs["plain"][i] == outputs["shared"][i] for i in range(len(prompts))
        ),
    }


def run(
    model: Any,
    prompt: Sequence[int],
    copies: int,
    system: Sequence[int],
    questions: Sequence[Sequence[int]],
    *,
    new_tokens: int = 16,
    repeats: int = 3,
    cache_tokens: int = 4096,
) -> dict[str, Any]:
    """Serve both bursts with shared prefills off and on; figures JSON-ready."""
    if copies < 2:
        raise ValueError(
            f"copies must be >= 2 (one prompt computed, the rest shared), got {copies}"
        )
    if len(questions) < 2:
        raise ValueError(
            f"need at least 2 questions behind the system prompt, got {len(questions)}"
        )
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    warm_up(model)  # first-call costs (allocator, kernels) land in neither run
    system_prompts = [[*system, *q] for q in questions]
    return {
        "new_tokens": new_tokens,
        "repeats": repeats,
        "cache_tokens": cache_tokens,
        "choices": _burst(model, [prompt] * copies, new_tokens, repeats, cache_tokens),
        "system": {
            "system_tokens": len(system),
            **_burst(model, system_prompts, new_tokens, repeats, cache_tokens),
        },
    }


TABLE_KEYS = (
    *LATENCY_KEYS,
    "prefill_tokens",
    "shared_tokens",
    "cached_tokens",
    "engine_steps",
    "wall_s",
)


def table_columns(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The four runs as ``render_table`` columns (rows: :data:`TABLE_KEYS`)."""
    return {
        f"{burst} {label}": fig[burst][mode]
        for burst in ("choices", "system")
        for mode, label in (("plain", "off"), ("shared", "on"))
    }
