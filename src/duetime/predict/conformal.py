"""Split conformal intervals: a held-out calibration set turns any predictor into [lo, hi].

Split conformal prediction (Vovk et al.; Lei et al. 2018): score each
calibration example with a *conformity score* ``s(x, y)``, sort the ``n``
scores, and take the ``k = ⌈(n + 1)·c⌉``-th smallest as the threshold ``τ``
for coverage ``c``. For a new example exchangeable with the calibration set,
``P(s(x, y) <= τ) >= c``, whatever the model: the interval is the set of
``y`` with ``s(x, y) <= τ``. Only the sorted scores are stored, so the
coverage can be chosen after training.

Two scores:

- :class:`ResidualConformal`, for point predictors (the baselines):
  ``|y − ŷ|`` (``log=False``, a band of constant width) or
  ``|log y − log ŷ|`` (``log=True``, a band of constant *ratio*, better for
  lengths spread over three decades).
- :class:`DistributionConformal`, for predictors of a distribution (the
  bucket classifier): ``|F̂(y | x) − ½|``, where ``F̂`` is the predicted CDF
  (distributional conformal prediction, Chernozhukov, Wüthrich & Zhu 2021).
  The interval is ``[F̂⁻¹(½ − τ), F̂⁻¹(½ + τ)]``: wide where the model is
  unsure, narrow where it is sure, and still covering ``c`` of the answers
  when the model is miscalibrated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def conformal_threshold(scores: np.ndarray, coverage: float) -> float:
    """The ``⌈(n + 1)·coverage⌉``-th smallest score; ``inf`` when ``n`` is too small for it."""
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be in (0, 1), got {coverage}")
    s = np.sort(np.asarray(scores, dtype=float))
    k = math.ceil((len(s) + 1) * coverage)
    return math.inf if k > len(s) else float(s[k - 1])


class ResidualConformal:
    """``[ŷ − τ, ŷ + τ]`` (or ``[ŷ·e^−τ, ŷ·e^τ]`` with ``log``), clipped at ``floor``."""

    def __init__(self, scores: Sequence[float] | np.ndarray, *, log: bool = False) -> None:
        self.scores = np.sort(np.asarray(scores, dtype=float))
        self.log = log

    @classmethod
    def fit(
        cls, y_true: np.ndarray, y_pred: np.ndarray, *, log: bool = False, floor: float = 1.0
    ) -> ResidualConformal:
        """Scores of a calibration set (predictions clipped at ``floor`` before the log)."""
        y, p = np.asarray(y_true, dtype=float), np.maximum(np.asarray(y_pred, float), floor)
        scores = np.abs(np.log(np.maximum(y, floor)) - np.log(p)) if log else np.abs(y - p)
        return cls(scores, log=log)

    def interval(
        self, y_pred: np.ndarray, coverage: float, *, floor: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        tau = conformal_threshold(self.scores, coverage)
        p = np.maximum(np.asarray(y_pred, dtype=float), floor)
        if self.log:
            lo, hi = p * math.exp(-tau), p * math.exp(tau)
        else:
            lo, hi = p - tau, p + tau
        return np.maximum(lo, floor), hi


class BucketCDF:
    """The piecewise-linear CDF of a distribution over length buckets.

    Bucket ``k`` (0-based) holds lengths in ``(k·B, (k + 1)·B]``, with its
    mass spread uniformly. ``probs`` is ``(n, K)``, rows summing to 1.
    """

    def __init__(self, probs: np.ndarray, bucket_size: int) -> None:
        probs = np.asarray(probs, dtype=np.float64)
        self.bucket_size = bucket_size
        self.probs = probs
        self.cum = np.cumsum(probs, axis=1)
        self.cum[:, -1] = 1.0  # no rounding gap at the top

    def cdf(self, y: np.ndarray) -> np.ndarray:
        """``F̂(y)`` for one ``y`` per row (clipped to the buckets' range)."""
        b = self.bucket_size
        k_max = self.probs.shape[1]
        y = np.clip(np.asarray(y, dtype=np.float64), 0.0, k_max * b)
        k = np.clip(np.ceil(y / b).astype(np.int64) - 1, 0, k_max - 1)
        rows = np.arange(len(y))
        below = np.where(k > 0, self.cum[rows, np.maximum(k - 1, 0)], 0.0)
        return below + self.probs[rows, k] * (y - k * b) / b

    def quantile(self, q: np.ndarray | float) -> np.ndarray:
        """``F̂⁻¹(q)`` per row: the smallest length whose CDF reaches ``q``."""
        b = self.bucket_size
        n, k_max = self.probs.shape
        q = np.broadcast_to(np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0), (n,))
        rows = np.arange(n)
        k = np.minimum((self.cum < q[:, None]).sum(axis=1), k_max - 1)
        below = np.where(k > 0, self.cum[rows, np.maximum(k - 1, 0)], 0.0)
        mass = self.probs[rows, k]
        frac = np.where(mass > 0, (q - below) / np.where(mass > 0, mass, 1.0), 1.0)
        return (k + np.clip(frac, 0.0, 1.0)) * b


class DistributionConformal:
    """Score ``|F̂(y) − ½|``; interval ``[F̂⁻¹(½ − τ), F̂⁻¹(½ + τ)]``."""

    def __init__(self, scores: Sequence[float] | np.ndarray) -> None:
        self.scores = np.sort(np.asarray(scores, dtype=float))

    @classmethod
    def fit(cls, cdf: BucketCDF, y_true: np.ndarray) -> DistributionConformal:
        return cls(np.abs(cdf.cdf(np.asarray(y_true, dtype=float)) - 0.5))

    def levels(self, coverage: float) -> tuple[float, float]:
        """The CDF levels ``(½ − τ, ½ + τ)`` the interval ends at."""
        tau = min(conformal_threshold(self.scores, coverage), 0.5)
        return 0.5 - tau, 0.5 + tau

    def interval(self, cdf: BucketCDF, coverage: float) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.levels(coverage)
        return cdf.quantile(a), cdf.quantile(b)


def coverage_and_width(y_true: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[float, float]:
    """Fraction of ``y_true`` inside ``[lo, hi]``, and the mean width ``hi − lo``."""
    y = np.asarray(y_true, dtype=float)
    inside = (y >= np.asarray(lo)) & (y <= np.asarray(hi))
    return float(inside.mean()), float(np.mean(np.asarray(hi) - np.asarray(lo)))
