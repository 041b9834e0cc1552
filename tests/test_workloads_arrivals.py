"""Arrival processes: rate, burstiness, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duetime.workloads.arrivals import (
    AllAtOnce,
    ArrivalProcess,
    Bursts,
    Gamma,
    Poisson,
    TraceArrivals,
    arrival_process,
)

N = 200_000


def _gaps(process: ArrivalProcess, seed: int = 1) -> np.ndarray:
    times = process.times(N, np.random.default_rng(seed))
    assert times.shape == (N,)
    assert np.all(np.diff(times) >= 0)
    return np.diff(times, prepend=getattr(process, "start", 0.0))


@pytest.mark.parametrize("rate", [0.5, 4.0, 200.0])
def test_poisson_rate_and_cv(rate: float) -> None:
    gaps = _gaps(Poisson(rate=rate))
    assert N / gaps.sum() == pytest.approx(rate, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("cv", [0.25, 1.0, 3.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    gaps = _gaps(Gamma(rate=10.0, cv=cv))
    assert N / gaps.sum() == pytest.approx(10.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_gamma_with_cv_one_is_poisson() -> None:
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    gamma, poisson = Gamma(rate=2.0, cv=1.0).times(N, rng_a), Poisson(rate=2.0).times(N, rng_b)
    # same law: quantiles of the gaps agree (different samples, so only statistically)
    q = [0.1, 0.5, 0.9, 0.99]
    np.testing.assert_allclose(
        np.quantile(np.diff(gamma), q), np.quantile(np.diff(poisson), q), rtol=0.03
    )


def test_seed_fixes_the_times_and_start_offsets_them() -> None:
    a = Poisson(rate=3.0, start=100.0).times(50, np.random.default_rng(7))
    b = Poisson(rate=3.0, start=100.0).times(50, np.random.default_rng(7))
    c = Poisson(rate=3.0, start=100.0).times(50, np.random.default_rng(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a[0] > 100.0


def test_infinite_rate_means_all_at_start() -> None:
    assert np.array_equal(
        Poisson(rate=math.inf, start=2.0).times(4, np.random.default_rng()), [2.0] * 4
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_bad_rate_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        Poisson(rate=bad)
    with pytest.raises(ValueError, match="rate must be > 0"):
        Gamma(rate=bad)


def test_gamma_rejects_non_positive_cv() -> None:
    with pytest.raises(ValueError, match="cv must be > 0"):
        Gamma(rate=1.0, cv=0.0)


def test_trace_arrivals_sorted_and_bounded() -> None:
    trace = TraceArrivals([3.0, 1.0, 2.0])
    assert trace.times(2, np.random.default_rng()).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="holds 3 arrival times, 4 were asked"):
        trace.times(4, np.random.default_rng())
    with pytest.raises(ValueError, match="finite and >= 0"):
        TraceArrivals([1.0, -2.0])


def test_all_at_once() -> None:
    assert AllAtOnce(at=5.0).times(3, np.random.default_rng()).tolist() == [5.0, 5.0, 5.0]


def test_bursts_come_whole_at_poisson_times() -> None:
    times = Bursts(rate=6.0, size=3).times(3_000, np.random.default_rng(0))
    starts, counts = np.unique(times, return_counts=True)
    assert counts.tolist() == [3] * 1_000  # every burst whole, none sharing an instant
    gaps = np.diff(np.concatenate([[0.0], starts]))
    assert gaps.mean() == pytest.approx(3 / 6.0, rel=0.08)  # rate requests/s in all
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps


def test_bursts_cut_the_last_one_short_and_size_one_is_poisson() -> None:
    assert len(Bursts(rate=1.0, size=4).times(10, np.random.default_rng(0))) == 10
    a = Bursts(rate=2.0, size=1).times(20, np.random.default_rng(5))
    b = Poisson(rate=2.0).times(20, np.random.default_rng(5))
    assert np.allclose(a, b)
    with pytest.raises(ValueError, match="burst size must be >= 1"):
        Bursts(rate=1.0, size=0)
    with pytest.raises(ValueError, match="a burst of 11 requests holds more than the 10"):
        Bursts(rate=1.0, size=11).times(10, np.random.default_rng(0))


def test_arrival_process_by_name() -> None:
    assert arrival_process("gamma", 2.0, cv=3.0) == Gamma(rate=2.0, cv=3.0)
    assert arrival_process("bursts", 2.0, burst_size=5) == Bursts(rate=2.0, size=5)
    with pytest.raises(ValueError, match="for --arrival bursts, not poisson"):
        arrival_process("poisson", 2.0, burst_size=5)
    with pytest.raises(ValueError, match="unknown arrival process 'weibull'; use poisson"):
        arrival_process("weibull", 2.0)
