"""Execution-time estimation: fit step-cost models to measured steps.

Two fits from the same measurements (``StepSample`` rows, one per timed step):

* TimeBill's workload-guided ETE: prefill ``t = aN² + bN + c`` on single-prompt
  prefill steps, decode ``t = p·N_kv + q`` on single-sequence decode steps
  (TimeBill, Sec. 4.2). Least squares, as in the paper, on relative residuals.
* The simulator's batch model, the full linear family of
  :class:`~duetime.core.cost.LinearStepCost` over every sample (mixed steps
  included), by non-negative least squares on *relative* residuals, so that a
  2 ms decode step counts as much as a 2 s prefill (the target is MAPE).

Both report MAPE on held-out samples; :func:`fit_profile` packs everything
into the profile JSON that ``duetime sim --profile`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from duetime.core.cost import LinearStepCost


@dataclass(slots=True, frozen=True)
class StepSample:
    """One timed engine step and its shape (the features of the cost model)."""

    prefill_tokens: int
    prefill_attn: float
    decode_seqs: int
    kv_tokens: int
    seconds: float
    kind: str = "mixed"  # "prefill" (one prompt alone), "decode" (decoders only) or "mixed"


def step_kind(prefill_tokens: int, decode_seqs: int) -> str:
    """A step's :attr:`StepSample.kind` from its shape: decoders only, prompt work only, or both."""
    if prefill_tokens == 0:
        return "decode"
    return "prefill" if decode_seqs == 0 else "mixed"


def _features(samples: Sequence[StepSample]) -> np.ndarray:
    p = np.array([s.prefill_tokens for s in samples], dtype=float)
    return np.column_stack(
        [
            np.ones(len(samples)),
            (p > 0).astype(float),
            p,
            [s.prefill_attn for s in samples],
            [s.decode_seqs for s in samples],
            [s.kv_tokens for s in samples],
        ]
    )


def mape_pct(pred: np.ndarray, actual: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(100.0 * np.mean(np.abs(pred - actual) / actual))


def cost_mape_pct(cost: LinearStepCost, samples: Sequence[StepSample]) -> float:
    """MAPE (%) of a step-cost model on timed steps."""
    pred = [cost.step_time(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.kv_tokens)
            for s in samples]  # fmt: skip
    return mape_pct(np.array(pred), np.array([s.seconds for s in samples]))


def fit_batch_cost(samples: Sequence[StepSample], name: str = "fitted") -> LinearStepCost:
    """NNLS fit of ``c0, c_prefill, a1, a2, b, d`` minimising relative error."""
    if len(samples) < 6:
        raise ValueError(f"need at least 6 timed steps to fit 6 coefficients, got {len(samples)}")
    x = _features(samples)
    y = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ValueError("every timed step must take > 0 s")
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls((x / scale) / y[:, None], np.ones_like(y))
    coef = coef / scale
    c0, c_prefill, a1, a2, b, d = (float(v) for v in coef)
    if c0 <= 0 and b <= 0:
        c0 = float(np.min(y)) * 1e-3  # keep the model valid: a decode step always costs something
    return LinearStepCost(c0=c0, c_prefill=c_prefill, a1=a1, a2=a2, b=b, d=d, name=name)


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


def fit_timebill(samples: Sequence[StepSample]) -> TimeBillETE:
    """Least-squares fits on single-prompt prefills and single-sequence decodes.

    The paper's forms (Sec. 4.2) fitted by least squares on relative residuals
    (:func:`_relative_lstsq`), because the estimator is judged by MAPE.
    """
    pre = [s for s in samples if s.kind == "prefill"]
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
    """MAPE of both models on ``samples``, per kind."""
    out: dict[str, float | None] = {}
    out["batch_model_mape_pct"] = cost_mape_pct(cost, samples) if len(samples) else None
    pre = [s for s in samples if s.kind == "prefill"]
    dec = [s for s in samples if s.kind == "decode" and s.decode_seqs == 1]
    out["ete_prefill_mape_pct"] = (
        mape_pct(
            np.array([ete.prefill(s.prefill_tokens) for s in pre]),
            np.array([s.seconds for s in pre]),
        )
        if pre
        else None
    )
    out["ete_decode_mape_pct"] = (
        mape_pct(
            np.array([ete.decode_step(s.kv_tokens) for s in dec]),
            np.array([s.seconds for s in dec]),
        )
        if dec
        else None
    )
    return out
