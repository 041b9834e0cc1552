"""ALA's analytical throughput curve and its fit (Ray et al., *Statistical Modeling and
Uncertainty Estimation of LLM Inference Systems*, Algorithms 1 and 2).

Throughput against batch size saturates: memory bandwidth and compute run out.
The paper models it as the *generalized exponential*::

    thpt(bb) = c − a·e^(−b·bb)

``c`` is the saturation throughput, ``a`` the size of the gain still to come,
``b`` how fast it comes. Per (ii, oo) workload the three parameters are
fitted by bounded non-linear least squares from the paper's initial guess,
built from the 10th and 90th percentiles of throughput and batch size.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

EPS_BB = 1e-3  # ε of Algorithm 2, line 9
FLOOR = 1e-5  # the max(·, 10⁻⁵) floors of Algorithm 2, lines 11-13
B_MAX = 10.0  # b beyond this is a step: the curve is flat from bb = 1


@dataclass(slots=True, frozen=True)
class CurveParams:
    """(a, b, c) of ``thpt = c − a·e^(−b·bb)``; a and c in tok/s, b per sequence."""

    a: float
    b: float
    c: float

    def __call__(self, bb: float | np.ndarray) -> np.ndarray:
        return curve(np.asarray(bb, dtype=np.float64), self.a, self.b, self.c)

    def as_array(self) -> np.ndarray:
        return np.array([self.a, self.b, self.c])


def curve(bb: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """Algorithm 1: ``c − a·exp(−b·bb)``."""
    return c - a * np.exp(-b * bb)


def initial_guess(bb: np.ndarray, thpt: np.ndarray) -> CurveParams:
    """Algorithm 2, lines 6-15: a₀, b₀, c₀ from the p10 / p90 of throughput and batch size.

    With a single batch size the paper's defaults (1, 0.001, 0) are returned.
    """
    if len(np.unique(bb)) <= 1:
        return CurveParams(1.0, 0.001, 0.0)
    t10, t90 = np.percentile(thpt, [10, 90])
    b10, b90 = np.percentile(bb, [10, 90])
    b90 = max(b90, b10 + EPS_BB)
    return CurveParams(
        a=max(t90 - t10, FLOOR),
        b=1.0 / max(b90 - b10, FLOOR),
        c=max(t90, FLOOR),
    )


def fit_curve(
    bb: np.ndarray, thpt: np.ndarray, min_batches: int = 3, relative: bool = True
) -> CurveParams | None:
    """Bounded least-squares fit of the curve to one workload's runs (Algorithm 2, l. 17).

    Returns None when the optimisation fails (the paper then leaves the
    workload out of the parameter database) or when fewer than
    ``min_batches`` distinct batch sizes were run: three parameters need
    three distinct points, and the paper's single-point defaults would
    store a curve the data never constrained.

    Throughput is divided by its maximum before fitting so one tolerance fits
    curves of 10 and of 10,000 tok/s; bounds keep ``a, c >= 0`` and
    ``0 < b <= B_MAX`` (the paper's "bounded constraints").

    ``relative`` minimises relative residuals (``sigma = thpt``) instead of
    absolute ones. The paper does not say which; ALA is judged by % error,
    and an absolute fit sacrifices small batches (on the shipped A100
    profile its median error at bb = 1 is 28 % against 2.5 % for the
    relative fit, 3.4 % against 3.1 % over all batch sizes).
    """
    bb = np.asarray(bb, dtype=np.float64)
    thpt = np.asarray(thpt, dtype=np.float64)
    if len(np.unique(bb)) < min_batches or not np.all(np.isfinite(thpt)):
        return None
    scale = float(np.max(thpt))
    if scale <= 0:
        return None
    y = thpt / scale
    g = initial_guess(bb, y)
    lo, hi = np.array([0.0, 1e-6, 0.0]), np.array([10.0, B_MAX, 10.0])
    p0 = np.clip(g.as_array(), lo + 1e-9, hi - 1e-9)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            popt, _ = curve_fit(
                curve,
                bb,
                y,
                p0=p0,
                sigma=y if relative else None,
                bounds=(lo, hi),
                method="trf",
                maxfev=2000,
            )
    except (RuntimeError, ValueError):
        return None
    if not np.all(np.isfinite(popt)):
        return None
    a, b, c = (float(v) for v in popt)
    return CurveParams(a * scale, b, c * scale)
