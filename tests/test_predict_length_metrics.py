"""The paired bootstrap interval of an MAE ratio (`bench predict-length`'s spread)."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.predict.length_metrics import mae_ratio_interval


def test_a_fixed_ratio_has_no_spread() -> None:
    err = np.random.default_rng(0).normal(0, 100, 500)
    assert mae_ratio_interval(err, err) == pytest.approx((1.0, 1.0))
    assert mae_ratio_interval(0.5 * err, -err) == pytest.approx((0.5, 0.5))


def test_the_interval_holds_the_ratio_and_narrows_with_more_rows() -> None:
    rng = np.random.default_rng(1)
    b = rng.lognormal(4, 1, 20_000)  # heavy-tailed, as answer-length errors are
    a = b * rng.uniform(0.6, 1.0, b.size)  # a is ~0.8 of b, row by row
    widths = []
    for n in (200, 2_000, 20_000):
        lo, hi = mae_ratio_interval(a[:n], b[:n])
        ratio = a[:n].mean() / b[:n].mean()
        assert lo < ratio < hi
        widths.append(hi - lo)
    assert widths[0] > 2 * widths[1] > 4 * widths[2]
    # pairing: errors shared by both predictors do not widen the ratio's interval
    shared = rng.lognormal(6, 1.5, 2_000)
    lo_p, hi_p = mae_ratio_interval(a[:2_000] + 0.8 * shared, b[:2_000] + shared)
    assert hi_p - lo_p < widths[1]
    assert mae_ratio_interval(a[:300], b[:300], seed=3) == mae_ratio_interval(
        a[:300], b[:300], seed=3
    )


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="equal, non-empty"):
        mae_ratio_interval(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="equal, non-empty"):
        mae_ratio_interval(np.ones(0), np.ones(0))
    with pytest.raises(ValueError, match="level"):
        mae_ratio_interval(np.ones(3), np.ones(3), level=1.5)
