"""ALA's learned half: XGBoost predicts the curve (a, b, c) of workloads never run,
and a histogram-similarity confidence says how far a query is from what was run.

Paper: Ray et al., *Statistical Modeling and Uncertainty Estimation of LLM
Inference Systems*. Algorithm 2 builds the parameter database ``P`` (one
fitted curve per (ii, oo)); Algorithm 3 trains a multi-output XGBoost on the
features below; Algorithm 5 predicts: look (ii, oo) up in ``P``, else ask
XGBoost, then evaluate ``c − a·e^(−b·bb)``. Algorithm 8's confidence is
``1 / (1 + d_min)`` with ``d_min`` the smallest mean per-feature cosine
distance between histograms of (ii, oo, bb). That feature set is our reading
of an ambiguous Sec. II-F, which names "the (ii, oo, bb, thpt) features" and
then histograms "for each feature, i.e., ii, bb, oo": leaving thpt out lets a
workload that was never run get a confidence, and makes the confidence blind
to hardware on the same grid (``docs/ala.md``).

:class:`AlaPredictor` is what the rest of duetime reads: a
:class:`ThroughputPrediction` (point, interval, confidence), the same three
things a :class:`~duetime.core.request.LengthPrediction` carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from duetime.predict.ala_curve import B_MAX, CurveParams, fit_curve
from duetime.predict.ala_data import ConfigData
from duetime.predict.ala_limits import check_shape

Pair = tuple[int, int]
FEATURES = ("ii", "oo", "log_ii", "log_oo", "log_ii_oo", "ii_oo_ratio", "ii_ii_ratio")


def features(ii: np.ndarray | float, oo: np.ndarray | float) -> np.ndarray:
    """Algorithm 3's seven features, one row per (ii, oo).

    ``log1p(ii/oo)`` is the paper's "log_bb" (a misnomer there: it involves no
    batch size); ``ii/(ii+1)`` is its normalised input ratio.
    """
    ii = np.atleast_1d(np.asarray(ii, dtype=np.float64))
    oo = np.atleast_1d(np.asarray(oo, dtype=np.float64))
    return np.column_stack(
        [ii, oo, np.log1p(ii), np.log1p(oo), np.log1p(ii / oo), ii / (oo + 1), ii / (ii + 1)]
    )


def _xgb(seed: int, n_estimators: int = 200) -> Any:
    from xgboost import XGBRegressor

    # Small trees, one thread: the databases have tens of rows, and the machine is shared.
    return XGBRegressor(
        n_estimators=n_estimators,
        max_depth=4,
        learning_rate=0.1,
        subsample=1.0,
        n_jobs=1,
        random_state=seed,
        verbosity=0,
    )


def fit_database(data: ConfigData, min_batches: int = 3) -> dict[Pair, CurveParams]:
    """Algorithm 2: one fitted curve per (ii, oo); failed fits are left out."""
    db: dict[Pair, CurveParams] = {}
    for pair in data.pairs():
        m = data.mask_pairs([pair])
        p = fit_curve(data.bb[m], data.thpt[m], min_batches=min_batches)
        if p is not None:
            db[pair] = p
    return db


class AlaModel:
    """Parameter database ``P`` plus the multi-output XGBoost ``M`` over it (Alg. 3, 5).

    ``log_targets`` trains on ``log a, log b, log c`` instead of the raw
    parameters (the paper's choice is raw); off by default.
    """

    def __init__(
        self, db: Mapping[Pair, CurveParams], *, seed: int = 0, log_targets: bool = False
    ) -> None:
        from sklearn.multioutput import MultiOutputRegressor

        if not db:
            raise ValueError("no (ii, oo) workload could be fitted: nothing to learn from")
        self.db = dict(db)
        self.log_targets = log_targets
        pairs = sorted(self.db)
        x = features(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
        y = np.array([self.db[p].as_array() for p in pairs])
        if log_targets:
            y = np.log(np.maximum(y, 1e-9))
        self.model = MultiOutputRegressor(_xgb(seed)).fit(x, y)

    @classmethod
    def fit(cls, data: ConfigData, *, seed: int = 0, log_targets: bool = False) -> AlaModel:
        return cls(fit_database(data), seed=seed, log_targets=log_targets)

    def params(self, ii: np.ndarray, oo: np.ndarray) -> np.ndarray:
        """(a, b, c) per row: from ``P`` when the workload was run, else from XGBoost."""
        ii = np.atleast_1d(np.asarray(ii, dtype=np.int64))
        oo = np.atleast_1d(np.asarray(oo, dtype=np.int64))
        out = np.asarray(self.model.predict(features(ii, oo)), dtype=np.float64)
        if self.log_targets:
            out = np.exp(out)
        for k, (i, o) in enumerate(zip(ii, oo, strict=True)):
            hit = self.db.get((int(i), int(o)))
            if hit is not None:
                out[k] = hit.as_array()
        out[:, 0] = np.maximum(out[:, 0], 0.0)
        out[:, 1] = np.clip(out[:, 1], 1e-6, B_MAX)
        out[:, 2] = np.maximum(out[:, 2], 1e-6)
        return out

    def predict(self, ii: np.ndarray, oo: np.ndarray, bb: np.ndarray) -> np.ndarray:
        """Predicted throughput (tok/s), Algorithm 5; never below 1e-6."""
        p = self.params(ii, oo)
        bb = np.atleast_1d(np.asarray(bb, dtype=np.float64))
        return np.maximum(p[:, 2] - p[:, 0] * np.exp(-p[:, 1] * bb), 1e-6)


# --- confidence: histogram similarity (Algorithm 8) ---------------------------------
_CENTRES = np.arange(-2.0, 22.0001, 0.25)  # log2 grid, 0.25 to 4M
SIGMA_LOG2 = 0.5  # kernel width in log2 units (a factor √2)


def histogram(values: np.ndarray) -> np.ndarray:
    """A smoothed histogram of ``values`` on a fixed log2 grid.

    The paper compares per-feature histograms but gives no bins. Plain bins
    make 256 and 257 tokens orthogonal; a Gaussian kernel (σ = 0.5 in log2)
    makes nearby sizes similar, so distance grows smoothly with how far a
    size is from those observed. Fixed bins keep vectors comparable across
    datasets.
    """
    v = np.log2(np.maximum(np.atleast_1d(np.asarray(values, dtype=np.float64)), 1e-9))
    k = np.exp(-0.5 * ((_CENTRES[None, :] - v[:, None]) / SIGMA_LOG2) ** 2)
    return np.asarray(k.sum(axis=0))


def cosine_distance(h1: np.ndarray, h2: np.ndarray) -> float:
    """``1 − cos(h1, h2)``; in [0, 1] for the non-negative histograms used here."""
    n = float(np.linalg.norm(h1) * np.linalg.norm(h2))
    return 1.0 if n == 0 else float(1.0 - np.dot(h1, h2) / n)


def set_distance(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> float:
    """Mean over features of the cosine distance of their histograms (Algorithm 8).

    ``a`` and ``b`` are (ii, oo, bb) value arrays of two datasets of any size.
    """
    return float(
        np.mean([cosine_distance(histogram(x), histogram(y)) for x, y in zip(a, b, strict=True)])
    )


def confidence_from_distance(d_min: float) -> float:
    """Algorithm 8, line 6: ``c = 1 / (1 + d_min)``; 1 on observed data, >= 0.5."""
    return 1.0 / (1.0 + d_min)


class PointConfidence:
    """Confidence of one (ii, oo, bb) query against the runs a model was trained on.

    A single query is a set of one; its nearest "observed subset" is the
    nearest single run, so ``d_min`` is the smallest mean per-feature
    histogram distance to a training run. Exactly on a run: c = 1; the
    further from every run, the closer to the formula's floor of 0.5.
    """

    def __init__(self, ii: np.ndarray, oo: np.ndarray, bb: np.ndarray) -> None:
        triples = np.unique(np.column_stack([ii, oo, bb]), axis=0)
        self._unit = [self._units(triples[:, j]) for j in range(3)]

    @staticmethod
    def _units(v: np.ndarray) -> np.ndarray:
        h = np.stack([histogram(np.array([x])) for x in v])
        n = np.linalg.norm(h, axis=1, keepdims=True)
        # a run off the grid (zero norm) gets a zero vector: distance 1 to any query
        return np.asarray(np.divide(h, n, out=np.zeros_like(h), where=n > 0))

    def __call__(self, ii: float, oo: float, bb: float) -> float:
        d = np.zeros(len(self._unit[0]))
        for units, q in zip(self._unit, (ii, oo, bb), strict=True):
            hq = histogram(np.array([q]))
            n = float(np.linalg.norm(hq))
            # Far off the grid the kernel's squares underflow: a zero (or non-finite)
            # norm. Such a value shares nothing with the runs: distance 1, as in
            # cosine_distance.
            if n > 0 and np.isfinite(n):
                d += np.clip(1.0 - units @ (hq / n), 0.0, 1.0)
            else:
                d += 1.0
        return confidence_from_distance(float(np.min(d / 3.0)))


# --- what policies read ---------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ThroughputPrediction:
    """Predicted throughput (tok/s) with an interval and a confidence in [0, 1].

    Same shape as :class:`~duetime.core.request.LengthPrediction`:
    ``lo <= point <= hi``. ``coverage`` is the interval's nominal coverage on
    held-out workloads; ``from_database`` is True when the workload was run
    (the curve was fitted to it, Algorithm 5's lookup).
    """

    point: float
    lo: float
    hi: float
    confidence: float
    coverage: float = 0.9
    from_database: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.point <= self.hi):
            raise ValueError(f"prediction must satisfy 0 <= lo <= point <= hi, got {self}")


class ThroughputPredictor(Protocol):
    """What a policy or router asks: tokens per second for a batch of a workload shape."""

    def predict_throughput(self, ii: int, oo: int, bb: int) -> ThroughputPrediction: ...


class AlaPredictor:
    """ALA fitted on every run of one configuration, with intervals and confidence.

    The interval half-width is a quantile of relative errors: of the curve fits
    themselves for workloads in the database, and of k-fold held-out
    workloads (folds over (ii, oo) pairs) otherwise; it is divided by the
    confidence so queries far from the data get wider intervals. That
    widening is ours, not the paper's.
    """

    def __init__(
        self,
        data: ConfigData,
        *,
        coverage: float = 0.9,
        folds: int = 5,
        seed: int = 0,
        log_targets: bool = False,
    ) -> None:
        if not 0 < coverage < 1:
            raise ValueError(f"coverage must be in (0, 1), got {coverage}")
        self.name = data.name
        self.coverage = coverage
        db = fit_database(data)
        if len(db) < 2:  # the held-out error, hence the interval, needs a pair to hold out
            raise ValueError(
                f"throughput config {data.name!r}: {len(db)} (ii, oo) workload(s) could be "
                "fitted, but ALA needs at least 2 (each with runs at 3 or more batch sizes)"
            )
        self.model = AlaModel(db, seed=seed, log_targets=log_targets)
        self.confidence = PointConfidence(data.ii, data.oo, data.bb)
        fit_err = np.abs(self.model.predict(data.ii, data.oo, data.bb) / data.thpt - 1.0)
        self.q_fit = float(np.quantile(fit_err, coverage))
        cv = heldout_errors(data, db, folds=folds, seed=seed, log_targets=log_targets)
        self.cv_folds = n_folds(folds, len(db))
        """Folds the held-out error really used (``folds`` capped by the pairs fitted)."""
        self.cv_median_err_pct = float(100 * np.median(cv))
        self.q_cv = float(np.quantile(cv, coverage))

    def predict_throughput(self, ii: int, oo: int, bb: int) -> ThroughputPrediction:
        """Throughput of ``bb`` requests of ``ii`` prompt and ``oo`` output tokens.

        ``ii`` and ``oo`` must be in [1, MAX_TOKENS], ``bb`` in [1, MAX_BATCH]
        (:mod:`duetime.predict.ala_limits`); otherwise ValueError.
        """
        check_shape(ii, oo, bb)
        point = float(self.model.predict(np.array([ii]), np.array([oo]), np.array([bb]))[0])
        hit = (ii, oo) in self.model.db
        c = self.confidence(ii, oo, bb)
        w = (self.q_fit if hit else self.q_cv) / c
        return ThroughputPrediction(
            point=point,
            lo=point * max(0.0, 1.0 - w),
            hi=point * (1.0 + w),
            confidence=c,
            coverage=self.coverage,
            from_database=hit,
        )


def n_folds(folds: int, n_pairs: int) -> int:
    """Folds :func:`heldout_errors` uses: ``folds``, at most one per pair, at least 2."""
    return max(2, min(folds, n_pairs))


def heldout_errors(
    data: ConfigData,
    db: Mapping[Pair, CurveParams],
    *,
    folds: int = 5,
    seed: int = 0,
    log_targets: bool = False,
) -> np.ndarray:
    """|relative error| of every run when its (ii, oo) pair is held out (k folds over pairs).

    Each pair's curve fit does not depend on other pairs, so the folds reuse
    ``db`` and retrain only XGBoost.
    """
    pairs = [p for p in data.pairs() if p in db]
    folds = n_folds(folds, len(pairs))
    order = np.random.default_rng(seed).permutation(len(pairs))
    errs: list[np.ndarray] = []
    for k in range(folds):
        test = {pairs[j] for j in order[k::folds]}
        train = {p: db[p] for p in pairs if p not in test}
        if not train:
            continue
        m = AlaModel(train, seed=seed, log_targets=log_targets)
        mask = data.mask_pairs(test)
        pred = m.predict(data.ii[mask], data.oo[mask], data.bb[mask])
        errs.append(np.abs(pred / data.thpt[mask] - 1.0))
    return np.concatenate(errs) if errs else np.array([np.nan])
