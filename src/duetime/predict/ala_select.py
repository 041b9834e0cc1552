"""ALA's search over training subsets and its error predictor (Algorithms 6, 7, 8).

Simulated annealing (Alg. 6) walks over training subsets, each evaluated by
the median % error of an ALA model trained on it; every step is logged. An
XGBoost regressor over binary encodings of the subsets (Alg. 7: one bit per
distinct ii, bb and oo value) learns the error a subset gives, and a new
dataset gets a predicted error plus the confidence ``1 / (1 + d_min)`` from
its histogram distance to the logged subsets (Alg. 8).

Our log also records the starting subset ``S₀`` as iteration 0, for the
record; Alg. 6 appends ``(S′, E′)`` only inside its loop, so
:class:`ErrorPredictor` learns from (and measures distance to) the loop's
entries alone, and falls back to ``S₀`` only when the loop ran no iteration.

A subset here is a set of values per feature, ``(S_ii, S_oo, S_bb)``; its
rows are the training runs whose three values are all in it. The paper
modifies subsets by "adding or deleting elements" and encodes them by the
values they contain; toggling one *value* per step makes every step change
the encoding, so the error predictor sees the effect of every move.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from duetime.predict.ala_curve import CurveParams, fit_curve
from duetime.predict.ala_data import ConfigData
from duetime.predict.ala_model import (
    AlaModel,
    _xgb,
    confidence_from_distance,
    cosine_distance,
    histogram,
)

S = TypeVar("S")


@dataclass(slots=True, frozen=True)
class Subset:
    """Values kept per feature; a run is in the subset when all three of its values are."""

    ii: frozenset[int]
    oo: frozenset[int]
    bb: frozenset[int]

    @classmethod
    def of(cls, data: ConfigData) -> Subset:
        """Every value present in ``data``."""
        return cls(*(frozenset(int(v) for v in np.unique(a)) for a in (data.ii, data.oo, data.bb)))

    def mask(self, data: ConfigData) -> np.ndarray:
        return (
            np.isin(data.ii, list(self.ii))
            & np.isin(data.oo, list(self.oo))
            & np.isin(data.bb, list(self.bb))
        )


@dataclass(slots=True, frozen=True)
class Step(Generic[S]):
    """One logged annealing iteration (Alg. 6, line 8), errors in %."""

    iteration: int
    subset: S
    err_pct: float
    accepted: bool
    current_err_pct: float
    best_err_pct: float
    tau: float


def anneal(
    evaluate: Callable[[S], float],
    s0: S,
    modify: Callable[[S, np.random.Generator], S],
    *,
    n_iter: int = 40,
    tau0: float = 1.0,
    alpha: float = 0.95,
    seed: int = 0,
    on_step: Callable[[Step[S]], None] | None = None,
) -> tuple[S, float, list[Step[S]]]:
    """Algorithm 6: returns the best subset seen, its error, and the log of every step.

    A worse candidate is accepted with probability ``exp((E* − E') / τ)``,
    ``τ`` cooling by ``alpha`` each step. The paper returns only the log; the
    best subset seen is returned too (the log would give it as well).
    Iteration 0 is the initial subset: logged here for the record, though the
    paper's log holds the loop's candidates only (:class:`ErrorPredictor` skips it).
    """
    rng = np.random.default_rng(seed)
    cur, cur_e = s0, evaluate(s0)
    best, best_e = cur, cur_e
    tau = tau0
    log: list[Step[S]] = [Step(0, s0, cur_e, True, cur_e, best_e, tau)]
    if on_step:
        on_step(log[0])
    for i in range(1, n_iter + 1):
        tau *= alpha
        cand = modify(cur, rng)
        e = evaluate(cand)
        accept = e < cur_e or (tau > 0 and math.exp((cur_e - e) / tau) > rng.random())
        if accept:
            cur, cur_e = cand, e
        if e < best_e:
            best, best_e = cand, e
        log.append(Step(i, cand, e, accept, cur_e, best_e, tau))
        if on_step:
            on_step(log[-1])
    return best, best_e, log


def toggle_value(
    universe: Subset, min_sizes: tuple[int, int, int] = (2, 2, 3)
) -> Callable[[Subset, np.random.Generator], Subset]:
    """ModifySubset: add or delete one random value of one random feature.

    A feature never drops below ``min_sizes`` (ii, oo, bb) values: a curve
    needs three batch sizes, the learner at least two of each length.
    """
    pools = (sorted(universe.ii), sorted(universe.oo), sorted(universe.bb))

    def modify(s: Subset, rng: np.random.Generator) -> Subset:
        sets = [set(s.ii), set(s.oo), set(s.bb)]
        for _ in range(100):
            f = int(rng.integers(3))
            v = pools[f][int(rng.integers(len(pools[f])))]
            if v in sets[f]:
                if len(sets[f]) <= min_sizes[f]:
                    continue
                sets[f].discard(v)
            else:
                sets[f].add(v)
            break
        return Subset(frozenset(sets[0]), frozenset(sets[1]), frozenset(sets[2]))

    return modify


class SubsetEvaluator:
    """EvaluateSubset: median % error on validation runs of ALA trained on a subset.

    A pair's curve fit depends only on which batch sizes it keeps, so fits are
    cached by (ii, oo, S_bb) and each evaluation mostly retrains XGBoost.
    """

    def __init__(self, train: ConfigData, val: ConfigData, seed: int = 0) -> None:
        self.train, self.val, self.seed = train, val, seed
        self._fits: dict[tuple[int, int, frozenset[int]], CurveParams | None] = {}
        self._errs: dict[Subset, float] = {}

    def model(self, s: Subset) -> AlaModel | None:
        db: dict[tuple[int, int], CurveParams] = {}
        t = self.train
        for i in sorted(s.ii):
            for o in sorted(s.oo):
                key = (i, o, s.bb)
                if key not in self._fits:
                    m = (t.ii == i) & (t.oo == o) & np.isin(t.bb, list(s.bb))
                    self._fits[key] = fit_curve(t.bb[m], t.thpt[m]) if m.any() else None
                p = self._fits[key]
                if p is not None:
                    db[(i, o)] = p
        return AlaModel(db, seed=self.seed) if db else None

    def __call__(self, s: Subset) -> float:
        if s not in self._errs:
            m = self.model(s)
            if m is None:
                self._errs[s] = math.inf
            else:
                v = self.val
                pred = m.predict(v.ii, v.oo, v.bb)
                self._errs[s] = float(100 * np.median(np.abs(pred / v.thpt - 1.0)))
        return self._errs[s]


def encode(s: Subset, universe: Subset) -> np.ndarray:
    """Algorithm 7, lines 5-10: one bit per universe value, in the order ii, bb, oo."""
    bits = [
        [1.0 if v in chosen else 0.0 for v in sorted(pool)]
        for chosen, pool in ((s.ii, universe.ii), (s.bb, universe.bb), (s.oo, universe.oo))
    ]
    return np.array([b for part in bits for b in part])


class ErrorPredictor:
    """Algorithm 7: XGBoost from a subset's encoding to the error it gave (%), plus
    Algorithm 8's confidence from histogram distance to the logged subsets.

    Both read the annealing loop's entries (``iteration >= 1``), as Alg. 6 logs
    them; the starting subset (iteration 0) is used only when the loop logged no
    finite error (``n_iter = 0``). :attr:`steps` holds the entries used.
    """

    def __init__(
        self,
        log: Sequence[Step[Subset]],
        universe: Subset,
        data: ConfigData,
        seed: int = 0,
    ) -> None:
        finite = [st for st in log if math.isfinite(st.err_pct)]
        steps = [st for st in finite if st.iteration > 0] or finite
        if not steps:
            raise ValueError("the annealing log has no finite error to learn from")
        self.steps: list[Step[Subset]] = steps
        self.universe = universe
        x = np.stack([encode(st.subset, universe) for st in steps])
        y = np.array([st.err_pct for st in steps])
        self.model = _xgb(seed, n_estimators=100).fit(x, y)
        self._hists = []
        for sub in {st.subset for st in steps}:
            m = sub.mask(data)
            self._hists.append(tuple(histogram(a[m]) for a in (data.ii, data.oo, data.bb)))

    def predict(self, s: Subset) -> float:
        """Predicted median % error of ALA trained on ``s`` (values outside the universe
        have no bit and are ignored, as in the paper's encoding)."""
        return float(self.model.predict(encode(s, self.universe)[None, :])[0])

    def confidence(self, data: ConfigData) -> float:
        """``1 / (1 + d_min)``, ``d_min`` the smallest mean per-feature histogram distance
        between ``data``'s runs and a logged subset's runs (Algorithm 8)."""
        h = [histogram(a) for a in (data.ii, data.oo, data.bb)]
        d_min = min(
            float(np.mean([cosine_distance(x, y) for x, y in zip(h, hs, strict=True)]))
            for hs in self._hists
        )
        return confidence_from_distance(d_min)
