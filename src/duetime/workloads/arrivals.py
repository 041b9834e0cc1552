"""When requests arrive: Poisson, gamma (bursty), bursts, a fixed trace, or all at once.

Each process is a few lines behind one method, ``times(n, rng)``, returning
``n`` sorted absolute times in seconds. Randomness comes only from the
``numpy.random.Generator`` passed in, so a seed fixes the workload. A renewal
process's first arrival is one inter-arrival gap after ``start``, not at it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ArrivalProcess(Protocol):
    """Produces arrival times; the only seam the builder needs."""

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` non-decreasing absolute arrival times (float64 seconds)."""
        ...


# Gamma cv outside this range is no workload (shape 1/cv² under- or overflows well before
# 1e-200 or inf, and 1e-3 is already a metronome, 1e3 one burst): refused, not computed.
CV_MIN, CV_MAX = 1e-3, 1e3


def _check_rate(rate: float) -> None:
    if not rate > 0:  # also rejects NaN
        raise ValueError(
            f"rate must be > 0 requests/s (inf: everything at the start), got {rate:g}"
        )


@dataclass(frozen=True, slots=True)
class Poisson:
    """Exponential gaps with mean ``1 / rate``: independent clients, the usual serving baseline."""

    rate: float
    start: float = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.start + np.cumsum(rng.exponential(1.0 / self.rate, size=n))


@dataclass(frozen=True, slots=True)
class Gamma:
    """Gamma gaps with mean ``1 / rate`` and coefficient of variation ``cv``.

    ``cv`` > 1 is burstier than Poisson, < 1 more regular, and ``cv = 1`` is
    exactly Poisson (shape 1). Shape ``k = 1 / cv²``, scale ``1 / (rate·k)``.
    ``cv`` must lie in [``CV_MIN``, ``CV_MAX``].
    """

    rate: float
    cv: float = 1.0
    start: float = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not CV_MIN <= self.cv <= CV_MAX:  # also rejects NaN and inf
            raise ValueError(
                f"cv must be > 0 and finite: a gamma coefficient of variation in "
                f"[{CV_MIN:g}, {CV_MAX:g}], got {self.cv}"
            )

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        shape = 1.0 / self.cv**2
        return self.start + np.cumsum(rng.gamma(shape, 1.0 / (self.rate * shape), size=n))


@dataclass(frozen=True, slots=True)
class Bursts:
    """``size`` requests at once, the bursts at Poisson times, ``rate`` requests/s in all.

    A fleet of robots sending their commands together, an agent fanning one task out
    into parallel calls: the server sees ``size`` requests in the same instant, then
    nothing for a while (gaps with mean ``size / rate``). Gamma gaps with a large
    ``cv`` cluster arrivals too, but in clusters of random size; here every burst is
    the same size, so what a server learns of one burst holds for the next.
    ``size = 1`` is exactly :class:`Poisson`.
    """

    rate: float
    size: int = 2
    start: float = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if self.size < 1:
            raise ValueError(f"burst size must be >= 1, got {self.size}")

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.size > n:  # one burst holds them all; np.repeat sized memory by the burst
            raise ValueError(
                f"a burst of {self.size} requests holds more than the {n} requested: "
                "give a --burst-size no larger than --requests"
            )
        bursts = -(-n // self.size)
        at = self.start + np.cumsum(rng.exponential(self.size / self.rate, size=bursts))
        return np.repeat(at, self.size)[:n]


#: The generated arrival processes, by the name a command line gives.
ARRIVALS = ("poisson", "gamma", "bursts")


def arrival_process(
    name: str, rate: float, *, cv: float = 1.0, burst_size: int = 1
) -> ArrivalProcess:
    """The process ``name`` (one of :data:`ARRIVALS`) at ``rate`` requests/s: ``cv``
    is gamma's coefficient of variation, ``burst_size`` the requests of a burst."""
    if burst_size != 1 and name != "bursts":
        raise ValueError(f"a burst size ({burst_size}) is for --arrival bursts, not {name}")
    if cv != 1.0 and name != "gamma":  # it was recorded as the run's, and changed nothing
        raise ValueError(f"a coefficient of variation ({cv:g}) is for --arrival gamma, not {name}")
    if name == "poisson":
        return Poisson(rate=rate)
    if name == "gamma":
        return Gamma(rate=rate, cv=cv)
    if name == "bursts":
        return Bursts(rate=rate, size=burst_size)
    raise ValueError(f"unknown arrival process {name!r}; use {', '.join(ARRIVALS)}")


@dataclass(frozen=True, slots=True)
class TraceArrivals:
    """Replays recorded times (sorted on the way in); asking for more than it holds is an error."""

    at: tuple[float, ...]

    def __init__(self, at: Sequence[float]) -> None:
        values = tuple(sorted(float(t) for t in at))
        if any(not math.isfinite(t) or t < 0 for t in values):
            raise ValueError("trace arrival times must be finite and >= 0")
        object.__setattr__(self, "at", values)

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n > len(self.at):
            raise ValueError(f"the trace holds {len(self.at)} arrival times, {n} were asked for")
        return np.asarray(self.at[:n], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class AllAtOnce:
    """Every request arrives at ``at``: an offline batch, for throughput runs."""

    at: float = 0.0

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.at, dtype=np.float64)
