"""Row-count regimes of the engine's kernels, and the step cost each regime adds.

Why: a CPU engine does not cost the same per row at every batch. Gemma q8 runs
a plain decode step of at most 8 rows through one C++ call of int8 kernels and
anything larger through bf16 matmuls; its output layer ranks the vocabulary in
int4 for greedy steps of at most 4 rows and in fbgemm int8 beyond. Each switch
changes both the fixed part of a step and its cost per row, so a model linear in
the decoders (one ``b·D``) missed whole regimes (held-out MAPE ~10 %, 3x the
noise floor measured the same day). Here the rows of a step are priced
piecewise: on each axis, the band a row count falls in adds ``intercept +
slope·rows``. The engine says where its bands are (``Gemma3.cost_regimes``);
the fit (:mod:`duetime.predict.ete`) prices them.

Two axes, because the two halves of a step see different row counts:

* ``rows``: tokens through the layers' linears, ``P + D`` (prefill tokens plus
  decoders);
* ``head_rows``: rows through the output layer, ``D + [P > 0]`` (each decoder,
  plus the prompt chunk's last token: one chunk per step is the common case).

For a fixed batch both are fixed, so k decode steps are still an arithmetic
series in the KV tokens and the simulator's closed form still skips them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Literal, overload

from duetime.core.attention_shape import AttentionShape

if TYPE_CHECKING:
    import numpy as np

Axis = Literal["rows", "head_rows"]
AXES: tuple[Axis, ...] = ("rows", "head_rows")


#: Rounding allowed below zero at a band's low end, relative to its intercept.
_TOLERANCE_S = 1e-9


class CostBandError(ValueError):
    """Bands or regimes that do not describe row counts."""


@dataclass(slots=True, frozen=True)
class CostRegimes:
    """Row counts at which the engine changes kernels, per axis, and the shape of its
    prompt attention.

    Each edge ends a band (inclusive): ``rows=(8,)`` means bands ``1-8`` and ``9+``.
    Empty: one band, the plain linear model. ``as_dict`` holds the axes only: a fitted
    cost model carries the attention shape itself (:attr:`LinearStepCost.attention`).
    """

    rows: tuple[int, ...] = ()
    head_rows: tuple[int, ...] = ()
    #: Where prompt attention changes kernel (by keys, not rows): priced in the ``A``
    #: term (:func:`~duetime.core.cost.chunk_attention`), not as a band.
    attention: AttentionShape | None = None

    def __post_init__(self) -> None:
        for axis in AXES:
            edges = getattr(self, axis)
            if any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
                raise CostBandError(f"{axis} edges must be increasing and >= 1, got {edges}")

    def edges(self, axis: Axis) -> tuple[int, ...]:
        return tuple(getattr(self, axis))

    def spans(self, axis: Axis) -> list[tuple[float, float]]:
        """``(lo, hi]`` of each band on ``axis``: lo exclusive, hi inclusive."""
        bounds = [0.0, *map(float, self.edges(axis)), math.inf]
        return list(pairwise(bounds))

    def band_label(self, axis: Axis, value: float) -> str:
        """A band's rows as people say them: ``1-8``, ``9+``."""
        lo, hi = self.spans(axis)[band_index(self.edges(axis), value)]
        return f"{int(lo) + 1}+" if math.isinf(hi) else f"{int(lo) + 1}-{int(hi)}"

    def as_dict(self) -> dict[str, list[int]]:
        return {axis: list(self.edges(axis)) for axis in AXES}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CostRegimes:
        unknown = set(raw) - set(AXES)
        if unknown:
            raise CostBandError(f"unknown regime axis {sorted(unknown)}; axes are {list(AXES)}")
        try:
            edges = {k: tuple(int(e) for e in v) for k, v in raw.items()}
            return cls(rows=edges.get("rows", ()), head_rows=edges.get("head_rows", ()))
        except (TypeError, ValueError) as e:
            raise CostBandError(f"regime edges must be lists of integers: {e}") from None


def band_index(edges: Sequence[int], value: float) -> int:
    """Index of the band ``value`` falls in (bands end at each edge, inclusive)."""
    return bisect_left(edges, value)


@dataclass(slots=True, frozen=True)
class BandCost:
    """Seconds a step adds when its row count on ``axis`` lies in ``(lo, hi]``.

    ``intercept + slope·rows``, ``slope >= 0``, and no less than 0 at ``lo``: a negative
    intercept is how a fitted knot's ``β·(rows − knot)`` is written.
    """

    axis: Axis
    lo: float
    hi: float
    intercept: float
    slope: float

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise CostBandError(f"band axis must be one of {list(AXES)}, got {self.axis!r}")
        if not self.lo < self.hi or self.lo < 0:
            raise CostBandError(f"a band needs 0 <= lo < hi, got ({self.lo}, {self.hi}]")
        if not math.isfinite(self.slope) or self.slope < 0:
            raise CostBandError(f"band slope must be finite and >= 0, got {self.slope}")
        if not math.isfinite(self.intercept):
            raise CostBandError(f"band intercept must be finite, got {self.intercept}")
        # a knot's band starts at zero cost: intercept −slope·lo (see predict.ete)
        at_lo = self.intercept + self.slope * self.lo
        if at_lo < -_TOLERANCE_S * max(1.0, abs(self.intercept)):
            raise CostBandError(
                f"a band's cost must be >= 0 over its rows, got {at_lo:g} s at {self.lo:g}"
            )

    def covers(self, rows: float) -> bool:
        return self.lo < rows <= self.hi

    def as_dict(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "lo": self.lo,
            "hi": None if math.isinf(self.hi) else self.hi,
            "intercept": self.intercept,
            "slope": self.slope,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BandCost:
        try:
            hi = raw.get("hi")
            return cls(
                axis=raw["axis"],
                lo=float(raw["lo"]),
                hi=math.inf if hi is None else float(hi),
                intercept=float(raw["intercept"]),
                slope=float(raw["slope"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CostBandError(f"a band needs axis, lo, hi, intercept, slope: {e}") from None


@overload
def step_rows(prefill_tokens: float, decode_seqs: float) -> tuple[float, float]: ...
@overload
def step_rows(
    prefill_tokens: np.ndarray, decode_seqs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]: ...
def step_rows(prefill_tokens: Any, decode_seqs: Any) -> tuple[Any, Any]:
    """``(rows, head_rows)`` of a step: see the module docstring.

    Elementwise on numpy arrays too, so the cost fit's feature columns
    (:mod:`duetime.predict.ete`) count rows exactly as the costs it fits price them.
    """
    return prefill_tokens + decode_seqs, decode_seqs + 1.0 * (prefill_tokens > 0)


def bands_time(bands: Iterable[BandCost], rows: float, head_rows: float) -> float:
    """Seconds the bands add to a step of ``rows`` layer rows and ``head_rows`` output rows."""
    t = 0.0
    for band in bands:
        x = rows if band.axis == "rows" else head_rows
        if band.lo < x <= band.hi:
            t += band.intercept + band.slope * x
    return t


def merge_bands(bands: Iterable[BandCost]) -> tuple[BandCost, ...]:
    """The same costs as disjoint bands: on each axis, one band per interval between
    all the edges, carrying the summed intercept and slope of the bands over it.

    Why: overlapping bands (a kernel regime plus the fit's knots) price the same as
    their sum, but every step's price loops over the bands, so fewer is faster.
    """
    out: list[BandCost] = []
    for axis in AXES:
        mine = [b for b in bands if b.axis == axis]
        edges = sorted({e for b in mine for e in (b.lo, b.hi)})
        for lo, hi in pairwise(edges):
            over = [b for b in mine if b.lo <= lo and hi <= b.hi]
            intercept = sum(b.intercept for b in over)
            slope = sum(b.slope for b in over)
            if intercept > 0 or slope > 0:
                out.append(BandCost(axis, lo, hi, intercept, slope))
    return tuple(out)
