"""Execution-time estimation: fit step-cost models to measured steps.

Two fits from the same measurements (``StepSample`` rows, one per timed step):

* TimeBill's workload-guided ETE: prefill ``t = aN² + bN + c`` on single-prompt
  prefill steps, decode ``t = p·N_kv + q`` on single-sequence decode steps
  (TimeBill, Sec. 4.2). Least squares, as in the paper, on relative residuals.
* The simulator's batch model, the full family of
  :class:`~duetime.core.cost.LinearStepCost` over every sample (mixed steps
  included), with a band per kernel regime the engine reports
  (:mod:`duetime.core.cost_bands`), non-negative, minimising the mean absolute
  *relative* error, so that a 2 ms decode step counts as much as a 2 s prefill
  (the target is MAPE).

Both report MAPE on held-out samples; :func:`fit_profile` packs everything
into the profile JSON that ``duetime sim --profile`` reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.cost_bands import AXES, BandCost, CostRegimes, merge_bands, step_rows


@dataclass(slots=True, frozen=True)
class StepSample:
    """One timed engine step and its shape (the features of the cost model)."""

    prefill_tokens: int
    prefill_attn: float
    decode_seqs: int
    kv_tokens: int
    seconds: float
    kind: str = "mixed"  # "prefill" (one prompt alone), "decode" (decoders only) or "mixed"
    #: Each prompt chunk's (rows computed, end position), where recorded: what
    #: ``prefill_attn`` was counted from, so a fit can recount it under another
    #: attention shape (:func:`~duetime.core.cost.chunk_attention`).
    chunks: tuple[tuple[int, int], ...] = ()


def step_kind(prefill_tokens: int, decode_seqs: int) -> str:
    """A step's :attr:`StepSample.kind` from its shape: decoders only, prompt work only, or both."""
    if prefill_tokens == 0:
        return "decode"
    return "prefill" if decode_seqs == 0 else "mixed"


#: Row counts at which a step's cost per layer row may bend although no kernel changes.
#: Why: a few rows cost what reading the layers' weights costs, and each row more
#: adds little; past some tens of rows the arithmetic sets the pace and each row
#: costs its full share (a roofline). On Gemma q8 a prompt's 8th to 16th tokens
#: added 0.38 ms each, its 16th to 64th 0.68, its 96th to 256th 0.78: one line
#: through them missed short and mid-sized prompts by 7-14 % each way
#: (results.md#profile-knots). None past 128: there the growth is attention's, which
#: the ``a2·A`` term prices for a chunk with context behind it too (knots at 256 and
#: 512, fitted on whole prompts, priced a 192-token chunk after 960 tokens like one
#: after none: 144 ms against the 185-231 ms such chunks took).
ROW_KNOTS: tuple[int, ...] = (16, 32, 64, 128)
#: Steps needed on each side of a knot before the fit bends there: past the last
#: knot the samples reach, a cost continues on its last measured slope.
MIN_STEPS_PER_SIDE = 3


def _knots(samples: Sequence[StepSample], knots: Sequence[int]) -> tuple[int, ...]:
    """The knots of ``knots`` with :data:`MIN_STEPS_PER_SIDE` samples' rows on each side."""
    rows = np.array([s.prefill_tokens + s.decode_seqs for s in samples], dtype=float)
    return tuple(
        k for k in knots
        if (rows <= k).sum() >= MIN_STEPS_PER_SIDE and (rows > k).sum() >= MIN_STEPS_PER_SIDE
    )  # fmt: skip


def _features(
    samples: Sequence[StepSample],
    regimes: CostRegimes | None = None,
    knots: Sequence[int] = (),
) -> np.ndarray:
    p = np.array([s.prefill_tokens for s in samples], dtype=float)
    d = np.array([s.decode_seqs for s in samples], dtype=float)
    cols = [
        np.ones(len(samples)),
        (p > 0).astype(float),
        p,
        np.array([s.prefill_attn for s in samples], dtype=float),
        d,
        np.array([s.kv_tokens for s in samples], dtype=float),
    ]
    if regimes is not None:
        for axis, x in zip(AXES, step_rows(p, d), strict=True):
            for lo, hi in regimes.spans(axis):
                on = ((x > lo) & (x <= hi)).astype(float)
                cols += [on, on * x]
    rows = p + d
    cols += [np.maximum(rows - k, 0.0) for k in knots]
    return np.column_stack(cols)


def mape_pct(pred: np.ndarray, actual: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(100.0 * np.mean(np.abs(pred - actual) / actual))


def priced_seconds(cost: LinearStepCost, samples: Sequence[StepSample]) -> np.ndarray:
    """What ``cost`` prices each timed step at, in the samples' order (seconds)."""
    return np.array(
        [cost.step_time(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens)
         for s in samples],
        dtype=float,
    )  # fmt: skip


def cost_mape_pct(cost: LinearStepCost, samples: Sequence[StepSample]) -> float:
    """MAPE (%) of a step-cost model on timed steps."""
    return mape_pct(priced_seconds(cost, samples), np.array([s.seconds for s in samples]))


def fit_batch_cost(
    samples: Sequence[StepSample],
    name: str = "fitted",
    regimes: CostRegimes | None = None,
    *,
    sum_calibrated: bool = False,
    extra: Sequence[StepSample] = (),
) -> LinearStepCost:
    """Fit ``c0, c_prefill, a1, a2, b, d`` (and, given ``regimes``, each band's intercept
    and slope), all >= 0, minimising the mean absolute relative error.

    The bands make the model piecewise in the step's rows where the engine's kernels
    change; a band no sample falls in gets zero cost (it prices nothing it has not seen).
    With ``regimes``, the layer rows also bend at each of :data:`ROW_KNOTS` the samples
    reach on both sides: a term ``β·max(rows − knot, 0)``, ``β >= 0``, so the cost stays
    continuous, its slope may only grow past the knot, and beyond the last knot the
    samples reach it goes on at the slope measured last. The fitted knots come back
    as bands (:func:`~duetime.core.cost_bands.merge_bands`).

    ``sum_calibrated``: scale every coefficient so that the model's time summed over the
    samples is their measured sum (the scale is kept as ``meta["sum_scale"]``). The
    relative-L1 fit prices a step at about its median, and a step's time is skewed
    right (a step now and then takes 2-3x its usual time on a shared machine), so a
    sum of steps, which is what a request lives through and what a forecast or a
    simulation adds up, comes out short by the mean-over-median gap: a simulated
    two-backend fleet ran 6-15 % faster than the real one on the uncalibrated online
    fits (docs/fleet-real.md).

    ``extra``: priced shapes fitted beside the timed ``samples``
    (:mod:`~duetime.predict.step_anchors`); the sum calibration counts the timed ones only.

    The samples' ``prefill_attn`` must be priced with ``regimes.attention`` (the engine's
    telemetry and profile grid are); the model keeps that shape to price chunks alike.
    """
    timed = len(samples)
    samples = [*samples, *extra]
    if len(samples) < 6:
        raise ValueError(f"need at least 6 timed steps to fit 6 coefficients, got {len(samples)}")
    knots = _knots(samples, ROW_KNOTS) if regimes is not None else ()
    x = _features(samples, regimes, knots)
    y = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ValueError("every timed step must take > 0 s")
    coef = _min_relative_l1(x, y)
    meta: dict[str, Any] = {} if regimes is None else {"regimes": regimes.as_dict()}
    if sum_calibrated:
        fitted = float(np.sum(x[:timed] @ coef))
        scale = float(np.sum(y[:timed])) / fitted if fitted > 0 else 1.0
        coef = coef * scale
        meta["sum_scale"] = round(scale, 4)
    c0, c_prefill, a1, a2, b, d = (float(v) for v in coef[:6])
    bands: list[BandCost] = []
    if regimes is not None:
        k = 6
        for axis in AXES:
            for lo, hi in regimes.spans(axis):
                intercept, slope = float(coef[k]), float(coef[k + 1])
                k += 2
                if intercept > 0 or slope > 0:
                    bands.append(BandCost(axis, lo, hi, intercept, slope))
        for knot, beta in zip(knots, coef[k:], strict=True):
            if beta > 0:  # β·max(rows − knot, 0): nothing up to the knot
                bands.append(
                    BandCost("rows", float(knot), math.inf, -float(beta) * knot, float(beta))
                )
        bands = list(merge_bands(bands))
    one = c0 + b + sum(bd.intercept + bd.slope for bd in bands if bd.covers(1.0))
    if one <= 0:
        c0 = float(np.min(y)) * 1e-3  # keep the model valid: a decode step always costs something
    return LinearStepCost(
        c0=c0, c_prefill=c_prefill, a1=a1, a2=a2, b=b, d=d, bands=tuple(bands),
        attention=None if regimes is None else regimes.attention, name=name, meta=meta,
    )  # fmt: skip


def load_solver() -> None:
    """Import the fit's solver (scipy's HiGHS linear programming) now.

    Why: its first import took ~0.5 s here, holding the GIL most of it. A server that
    fits on a thread of its own imports it at start, not beside the requests of the
    first fit.
    """
    import scipy.optimize  # noqa: F401  (imported for its side effect: loaded)


def _min_relative_l1(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``β >= 0`` minimising ``Σ |x·β − y| / y``: the mean absolute percentage error itself.

    A linear programme (HiGHS): ``min Σ u`` with ``−u <= (x·β − y)/y <= u``. Why not least
    squares on relative residuals: on a shared machine a step now and then takes 2-3x its
    usual time, and squared error chases those; it also biases every prediction low (the
    best constant under squared relative error is ``E[1/y] / E[1/y²]``, below the median).
    On 526 steps of Gemma q8 the squared fit ran 2-10 % under the median step of most
    regimes; this one within 2.2 % in every regime with more than 20 steps. Columns are
    scaled to their maxima first (they differ by 10^6).
    """
    from scipy import sparse
    from scipy.optimize import linprog

    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    a = sparse.csr_matrix((x / scale) / y[:, None])
    n, k = a.shape
    eye = sparse.identity(n, format="csr")
    a_ub = sparse.vstack([sparse.hstack([a, -eye]), sparse.hstack([-a, -eye])], format="csr")
    ones = np.ones(n)
    res = linprog(
        np.r_[np.zeros(k), ones], A_ub=a_ub, b_ub=np.r_[ones, -ones], bounds=(0, None),
        method="highs",
    )  # fmt: skip
    if res.status != 0:  # cannot happen for finite data (β = 0, u = 1 is feasible)
        raise ValueError(f"the cost fit failed: {res.message}")
    return np.asarray(res.x[:k]) / scale


@dataclass(slots=True, frozen=True)
class TimeBillETE:
    """TimeBill's estimator: ``t_prefill(N) = aN² + bN + c``, ``t_decode(N_kv) = p·N_kv + q``."""

    a: float
    b: float
    c: float
    p: float
    q: float

    def prefill(self, n: np.ndarray | float) -> np.ndarray | float:
        return self.a * np.square(n) + self.b * n + self.c

    def decode_step(self, n_kv: np.ndarray | float) -> np.ndarray | float:
        return self.p * n_kv + self.q

    def e2e(self, prompt_len: int, output_len: int, keep_ratio: float = 1.0) -> float:
        """Prefill plus ``output_len − 1`` decode steps over a KV kept at ``keep_ratio``.

        With eviction after prefill, step i attends ``keep·N + i`` tokens.
        """
        n = prompt_len
        steps = max(output_len - 1, 0)
        kv0 = keep_ratio * n
        return (
            float(self.prefill(n))
            + steps * (self.q + self.p * kv0)
            + self.p * steps * (steps - 1) / 2
        )

    def as_cost(self) -> LinearStepCost:
        return LinearStepCost.timebill(
            a=max(self.a, 0.0), b=max(self.b, 0.0), c=max(self.c, 0.0),
            p=max(self.p, 0.0), q=max(self.q, 1e-9),
        )  # fmt: skip


def _relative_lstsq(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares on relative residuals: minimise ``Σ ((x·β − t) / t)²``.

    Plain least squares lets the longest prompts (2 s) set the curve and leaves
    the short ones (40 ms) with 10-20 % errors; dividing each row by its own
    time weights every sample alike, which is what a MAPE target asks for.
    """
    if np.any(t <= 0):
        raise ValueError("every timed step must take > 0 s")
    return np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]


def whole_prompts(samples: Sequence[StepSample]) -> list[StepSample]:
    """The steps that prefill whole prompts alone: TimeBill's ``t_prefill(N)`` is a whole
    prompt's, so a chunk after its past (priced by it as a prompt of the chunk's rows,
    128-140 ms against the 72-88 ms a whole 192-token prompt took) is not its to predict.
    A step with no recorded chunks counts as whole."""
    return [
        s for s in samples if s.kind == "prefill" and all(rows == end for rows, end in s.chunks)
    ]


def fit_timebill(samples: Sequence[StepSample]) -> TimeBillETE:
    """Least-squares fits on whole prompts alone (:func:`whole_prompts`) and
    single-sequence decodes.

    The paper's forms (Sec. 4.2) fitted by least squares on relative residuals
    (:func:`_relative_lstsq`), because the estimator is judged by MAPE.
    """
    pre = whole_prompts(samples)
    dec = [s for s in samples if s.kind == "decode" and s.decode_seqs == 1]
    if len(pre) < 3 or len(dec) < 2:
        raise ValueError(
            f"TimeBill's ETE needs >= 3 prefill and >= 2 batch-1 decode samples, "
            f"got {len(pre)} and {len(dec)}"
        )
    n = np.array([s.prefill_tokens for s in pre], dtype=float)
    t = np.array([s.seconds for s in pre])
    a, b, c = _relative_lstsq(np.column_stack([n * n, n, np.ones_like(n)]), t)
    k = np.array([s.kv_tokens for s in dec], dtype=float)
    td = np.array([s.seconds for s in dec])
    p, q = _relative_lstsq(np.column_stack([k, np.ones_like(k)]), td)
    return TimeBillETE(float(a), float(b), float(c), float(p), float(q))


def split_samples(
    samples: Sequence[StepSample], holdout: float = 0.25, seed: int = 0
) -> tuple[list[StepSample], list[StepSample]]:
    """Seeded random train / held-out split."""
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(samples))
    k = max(1, round(holdout * len(samples)))
    held = set(idx[:k].tolist())
    train = [s for i, s in enumerate(samples) if i not in held]
    test = [s for i, s in enumerate(samples) if i in held]
    return train, test


def evaluate(
    cost: LinearStepCost, ete: TimeBillETE, samples: Sequence[StepSample]
) -> dict[str, float | None]:
    """MAPE of both models on ``samples``: the batch model on all and on each kind of
    step, TimeBill's ETE on its own kinds (whole prompts alone, single-sequence decodes)."""
    out: dict[str, float | None] = {}
    out["batch_model_mape_pct"] = cost_mape_pct(cost, samples) if len(samples) else None
    for kind in ("prefill", "decode", "mixed"):  # the batch model on each kind of step
        of_kind = [s for s in samples if s.kind == kind]
        out[f"model_{kind}_mape_pct"] = cost_mape_pct(cost, of_kind) if of_kind else None
    pre = whole_prompts(samples)
    dec = [s for s in samples if s.kind == "decode" and s.decode_seqs == 1]
    out["ete_prefill_mape_pct"] = _mape_on(lambda s: ete.prefill(s.prefill_tokens), pre)
    out["ete_decode_mape_pct"] = _mape_on(lambda s: ete.decode_step(s.kv_tokens), dec)
    return out


def _mape_on(
    predict: Callable[[StepSample], np.ndarray | float], samples: Sequence[StepSample]
) -> float | None:
    """MAPE (%) of ``predict`` on ``samples``; ``None`` without any, since a run need not
    have timed every kind of step a model is scored on."""
    if not samples:
        return None
    return mape_pct(np.array([predict(s) for s in samples]), np.array([s.seconds for s in samples]))
