"""A fitted step-cost model judged against the machine: its error beside the noise floor.

A model cannot predict a step closer than the step repeats itself, so an error
figure alone says little: 9 % is poor on a quiet machine whose steps repeat
within 3 %, and as good as it gets on a busy one whose steps spread by 10 %.
``profile`` and ``validate`` print the error next to the floor: below 1.5x the
floor the model is at the machine's limit; above it, the table of step shapes
(decode batch band x prompt size) says where it misses most.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.cost_bands import CostRegimes
from duetime.predict.ete import (
    StepSample,
    evaluate,
    fit_batch_cost,
    fit_timebill,
    priced_seconds,
    split_samples,
)

__all__ = [
    "AT_LIMIT_FACTOR",
    "at_noise_limit",
    "check_profile_engine",
    "engine_of",
    "fit_eviction_cost",
    "floor_verdict",
    "miss_table",
    "profile_payload",
    "repeat_floor_pct",
    "speed_against_profile",
]

#: Error within this factor of the noise floor: the model is as good as the machine allows.
AT_LIMIT_FACTOR = 1.5
_PROMPT_EDGES = (0, 64, 256, 1024)


def floor_verdict(error_pct: float, floor_pct: float | None) -> str:
    """One line: the error beside the floor, and what that means."""
    if floor_pct is None:
        return f"error {error_pct:.1f} % (no noise floor measured)"
    ratio = error_pct / floor_pct if floor_pct > 0 else float("inf")
    if at_noise_limit(error_pct, floor_pct):
        return (
            f"error {error_pct:.1f} % vs noise floor {floor_pct:.1f} % ({ratio:.1f}x): "
            "at the machine's limit"
        )
    return (
        f"error {error_pct:.1f} % vs noise floor {floor_pct:.1f} % ({ratio:.1f}x, above "
        f"{AT_LIMIT_FACTOR}x): the model misses; see the table of step shapes"
    )


def at_noise_limit(error_pct: float | None, floor_pct: float | None) -> bool | None:
    """Whether the error is within :data:`AT_LIMIT_FACTOR` of the floor (None: unknown)."""
    if error_pct is None or floor_pct is None:
        return None
    return error_pct <= AT_LIMIT_FACTOR * floor_pct


def _batch_bands(regimes: CostRegimes | None) -> tuple[int, ...]:
    edges = set() if regimes is None else {*regimes.rows, *regimes.head_rows}
    return tuple(sorted(edges | {32}))


def _label(edges: Sequence[int], value: int, *, zero: bool = False) -> str:
    if zero and value == 0:
        return "0"
    lo = 0
    for hi in edges:
        if value <= hi:
            return f"{lo + 1}-{hi}"
        lo = hi
    return f"{lo + 1}+"


def miss_table(
    cost: LinearStepCost, samples: Sequence[StepSample], regimes: CostRegimes | None = None
) -> list[dict[str, Any]]:
    """MAPE and median signed error per (decode batch band, prompt tokens) cell.

    Ordered by the cell's share of the total error (steps x MAPE), largest first: a
    cell of one unlucky step is noise, one of many steps a regime the model misses.
    """
    cells: dict[tuple[str, str], list[float]] = {}
    batch_edges = _batch_bands(regimes)
    for s, pred in zip(samples, priced_seconds(cost, samples), strict=True):
        key = (
            "0" if s.decode_seqs == 0 else _label(batch_edges, s.decode_seqs),
            _label(_PROMPT_EDGES[1:], s.prefill_tokens, zero=True),
        )
        cells.setdefault(key, []).append((pred - s.seconds) / s.seconds)
    total = sum(len(v) * float(np.mean(np.abs(v))) for v in cells.values()) or 1.0
    rows: list[dict[str, Any]] = [
        {
            "decoders": k[0],
            "prompt_tokens": k[1],
            "steps": len(v),
            "mape_pct": float(100 * np.mean(np.abs(v))),
            "median_error_pct": float(100 * np.median(v)),
            "error_share_pct": 100.0 * len(v) * float(np.mean(np.abs(v))) / total,
        }
        for k, v in cells.items()
    ]
    return sorted(rows, key=lambda r: -r["error_share_pct"])


#: Steps of one shape a run must hold before their spread counts in its floor.
MIN_REPEATS = 5
#: KV tokens a decoder within which two steps count as one shape (a decoder's KV term
#: moves a step by well under 1 % across it).
KV_TOKENS_PER_SHAPE = 16


def repeat_floor_pct(samples: Sequence[StepSample]) -> tuple[float | None, int]:
    """A run's own floor: its steps of one shape, timed at different moments.

    Returns the mean absolute deviation of each step from its shape's median, % of that
    median, over the shapes with :data:`MIN_REPEATS` steps or more, and how many steps
    that is (None and 0 without any). A shape is the prompt rows, the decoders and the
    KV tokens to within :data:`KV_TOKENS_PER_SHAPE` a decoder.

    Why: identical steps repeated back to back spread 2-7 % on machine E, while the
    same shape timed across a 100-second `validate` run spread 7-14 %: the machine's
    speed moves between 5-second windows (results.md#validate-floor). A model scored
    on steps spread over a run meets that spread, so the verdict sets it beside them.
    """
    shapes: dict[tuple[int, int, int], list[float]] = {}
    for st in samples:
        per = KV_TOKENS_PER_SHAPE * max(st.decode_seqs, 1)
        shapes.setdefault((st.prefill_tokens, st.decode_seqs, st.kv_tokens // per), []).append(
            st.seconds
        )
    devs: list[float] = []
    for times in shapes.values():
        if len(times) >= MIN_REPEATS:
            t = np.array(times)
            med = float(np.median(t))
            devs += (np.abs(t - med) / med).tolist()
    return (100.0 * float(np.mean(devs)) if devs else None), len(devs)


def fit_eviction_cost(samples: Sequence[tuple[int, float]]) -> float:
    """``e`` in seconds per KV token held, least squares through the origin (0 if none)."""
    n = sum(h * h for h, _ in samples)
    return sum(h * s for h, s in samples) / n if n else 0.0


def profile_payload(
    samples: Sequence[StepSample],
    *,
    name: str,
    source: str,
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_batch_tokens: int,
    regimes: CostRegimes | None = None,
    noise_floor_pct: float | None = None,
    noise: Sequence[dict[str, Any]] = (),
    noise_drift_pct: float | None = None,
    repeat_floor: float | None = None,
    holdout: float = 0.25,
    seed: int = 0,
    evictions: Sequence[tuple[int, float]] = (),
    engine: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Fit both models on a train split, score them on the held-out split, pack a profile.

    The coefficients written are refitted on *all* samples (the held-out scores say
    how well that procedure generalises). ``regimes``: the engine's kernel bands
    (``duetime.engine.cost_regimes.regimes_of``). ``evictions`` (KV tokens held,
    seconds: ``duetime.engine.profile.measure_evictions``) set ``e``. The
    result is what ``LinearStepCost.from_profile`` and ``duetime sim --profile`` read.
    ``repeat_floor``: :func:`repeat_floor_pct` of the timed steps of a serving run; the
    verdict takes the larger of it and ``noise_floor_pct`` (``verdict_floor_pct``).
    ``engine``: what was timed (:func:`engine_of`), checked by :func:`check_profile_engine`.
    """
    train, test = split_samples(samples, holdout, seed)
    fitted = fit_batch_cost(train, regimes=regimes)
    heldout = evaluate(fitted, fit_timebill(train), test)
    cost = fit_batch_cost(samples, name=name, regimes=regimes)
    if evictions:
        cost = dataclasses.replace(cost, e=fit_eviction_cost(evictions))
    ete = fit_timebill(samples)
    error = heldout["batch_model_mape_pct"]
    floors = [f for f in (noise_floor_pct, repeat_floor) if f is not None]
    floor = max(floors) if floors else None
    payload = cost.to_profile()
    payload.update(
        {
            "kv_capacity_tokens": kv_capacity_tokens,
            "max_num_seqs": max_num_seqs,
            "max_batch_tokens": max_batch_tokens,
            "units": "seconds per unit; t = c0 + c_prefill*[P>0] + a1*P + a2*A + b*D + d*KV "
            "+ per band on its axis (rows = P + D, head_rows = D + [P>0]): "
            "intercept + slope*rows",
            "source": source,
            "timebill_ete": {"a": ete.a, "b": ete.b, "c": ete.c, "p": ete.p, "q": ete.q},
            "heldout": {**heldout, "samples": len(test), "train_samples": len(train)},
            "noise_floor_pct": noise_floor_pct,
            "noise": list(noise),
            "noise_drift_pct": noise_drift_pct,
            "repeat_floor_pct": repeat_floor,
            "verdict_floor_pct": floor,
            "verdict": None if error is None else floor_verdict(error, floor),
            "at_noise_limit": at_noise_limit(error, floor),
            "misses": miss_table(fitted, test, regimes),
            "evictions": [{"kv_tokens": h, "seconds": sec} for h, sec in evictions],
            "samples": len(samples),
        }
    )
    if engine is not None:
        payload["engine"] = dict(engine)
    return payload


def engine_of(dtype: str, threads: int) -> dict[str, object]:
    """The engine a profile times, as the profile records it (``"engine"``)."""
    return {"dtype": dtype, "threads": threads}


def check_profile_engine(meta: Mapping[str, Any], where: str, dtype: str, threads: int) -> None:
    """Refuse a profile (``meta``: its fields, :attr:`LinearStepCost.meta`; ``where``:
    its name or path) timed on another engine than the one about to run.

    Why: its step costs describe that engine, not this one (a q8 decode step at
    batch 1 took 4.8 ms against fp32's 51 ms on a 2-core EPYC), so every forecast,
    batch size and validation built on it would be off by that factor. A profile
    that records no engine (a shipped or older one, or ``profile --url``) is taken
    as given.
    A ValueError names both engines and the two ways out.
    """
    recorded = meta.get("engine")
    if not isinstance(recorded, dict):
        return
    want = engine_of(dtype, threads)
    if all(recorded.get(k) == v for k, v in want.items()):
        return
    was_dtype, was_threads = recorded.get("dtype"), recorded.get("threads")
    raise ValueError(
        f"{where} was timed on the {was_dtype} engine with {was_threads} threads, and this "
        f"run is {dtype} with {threads}: its step costs describe another engine. Give "
        f"--dtype {was_dtype} --threads {was_threads}, or run `duetime profile --dtype "
        f"{dtype} --threads {threads}` first."
    )


def speed_against_profile(meta: Mapping[str, Any], now: Sequence[Any]) -> float | None:
    """How slow the machine runs now against when a profile was timed: the geometric
    mean, over the noise shapes both timed (``meta["noise"]``, the profile's; ``now``:
    :class:`~duetime.engine.profile.NoiseShape` rows), of now's median over the
    profile's. None when they share no shape (a shipped or black-box profile).

    Why: the machine's speed level moves by 5-10 % between minutes here, and a
    profile timed in a faster minute prices every step of a slower one short.
    """
    recorded: dict[str, float] = {}
    for n in meta.get("noise", ()):
        median = n.get("median_s") if isinstance(n, dict) else None
        if isinstance(median, int | float) and median > 0:
            recorded[str(n.get("name"))] = float(median)
    ratios = [s.median_s / recorded[s.name] for s in now if s.name in recorded]
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else None
