"""How good a length predictor is: the figures TimeBill reports, plus interval quality."""

from __future__ import annotations

import numpy as np

from duetime.predict.conformal import coverage_and_width
from duetime.predict.length_model import bucket_of


def length_metrics(
    y_true: np.ndarray,
    point: np.ndarray,
    lo: np.ndarray | None = None,
    hi: np.ndarray | None = None,
    *,
    bucket_size: int = 16,
) -> dict[str, float]:
    """MAE, RMSE (tokens), R², bucket accuracy, and interval coverage and width.

    ``bucket_acc``: the share of answers whose bucket ``⌈N / B⌉`` equals the
    bucket of the point estimate (TimeBill's classification accuracy, for any
    predictor). ``r2`` is against the mean of ``y_true`` itself (it can be
    negative: a constant fitted elsewhere scores below 0).
    """
    y = np.asarray(y_true, dtype=np.float64)
    p = np.asarray(point, dtype=np.float64)
    err = p - y
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    out = {
        "n": float(len(y)),
        "mae_tokens": float(np.mean(np.abs(err))),
        "rmse_tokens": float(np.sqrt(np.mean(err**2))),
        "r2": 1.0 - float(np.sum(err**2)) / ss_tot if ss_tot > 0 else 0.0,
        "bucket_acc": float(np.mean(bucket_of(p, bucket_size) == bucket_of(y, bucket_size))),
    }
    if lo is not None and hi is not None:
        cov, width = coverage_and_width(y, lo, hi)
        out |= {"coverage": cov, "interval_width_tokens": width}
        out["interval_width_median_tokens"] = float(np.median(np.asarray(hi) - np.asarray(lo)))
    return out
