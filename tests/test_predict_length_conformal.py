"""Split conformal intervals reach their nominal coverage on synthetic data, whatever the model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duetime.predict.conformal import (
    BucketCDF,
    DistributionConformal,
    ResidualConformal,
    conformal_threshold,
    coverage_and_width,
)

N_CAL, N_TEST, TOL = 5_000, 20_000, 0.015


def _lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A feature and a skewed 'answer length' that depends on it (log-normal noise)."""
    x = rng.uniform(0, 1, n)
    y = np.ceil(np.exp(4.0 + 2.0 * x + rng.normal(0, 0.8, n)))
    return x, y


def test_threshold_is_the_finite_sample_quantile():
    scores = np.arange(1, 10)  # n = 9: ⌈10 · 0.9⌉ = 9th smallest
    assert conformal_threshold(scores, 0.9) == 9
    assert conformal_threshold(scores, 0.5) == 5
    assert math.isinf(conformal_threshold(scores[:3], 0.9))  # too few scores for 90 %
    with pytest.raises(ValueError, match="coverage"):
        conformal_threshold(scores, 1.0)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("coverage", [0.8, 0.9, 0.95])
def test_residual_conformal_covers(log, coverage):
    rng = np.random.default_rng(0)
    x_cal, y_cal = _lengths(N_CAL, rng)
    x_te, y_te = _lengths(N_TEST, rng)
    predict = lambda x: np.exp(4.2 + 1.5 * x)  # noqa: E731 - a deliberately biased model
    conf = ResidualConformal.fit(y_cal, predict(x_cal), log=log)
    lo, hi = conf.interval(predict(x_te), coverage)
    cov, _ = coverage_and_width(y_te, lo, hi)
    assert cov >= coverage - TOL


@pytest.mark.parametrize("coverage", [0.8, 0.9, 0.95])
def test_distribution_conformal_covers_even_when_the_model_is_overconfident(coverage):
    rng = np.random.default_rng(1)
    b, k = 16, 128
    edges = (np.arange(k) + 0.5) * b

    def model(x: np.ndarray) -> BucketCDF:
        # Too narrow (σ 0.3 where the truth has 0.8) and biased: raw quantiles undercover.
        mu = 4.3 + 1.6 * x
        logits = -0.5 * ((np.log(edges)[None, :] - mu[:, None]) / 0.3) ** 2
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return BucketCDF(p / p.sum(axis=1, keepdims=True), b)

    x_cal, y_cal = _lengths(N_CAL, rng)
    x_te, y_te = _lengths(N_TEST, rng)
    y_cal, y_te = np.minimum(y_cal, k * b), np.minimum(y_te, k * b)
    raw_lo = model(x_te).quantile((1 - coverage) / 2)
    raw_hi = model(x_te).quantile((1 + coverage) / 2)
    assert coverage_and_width(y_te, raw_lo, raw_hi)[0] < coverage - 0.1  # the model alone fails
    conf = DistributionConformal.fit(model(x_cal), y_cal)
    lo, hi = conf.interval(model(x_te), coverage)
    cov, width = coverage_and_width(y_te, lo, hi)
    assert cov >= coverage - TOL
    assert cov <= coverage + 0.03  # and is not trivially wide
    assert width < k * b
