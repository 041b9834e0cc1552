"""The prediction intervals of the Amin/Amax paper's experiments (Chen, Ye, Zhou 2025, Sec. 6).

Each is built from the true output length ``o``, so it runs on the executor
side like the oracle (it is handed the :class:`Job`) and writes
``Request.predicted``; Amin reads only ``lo``, Amax only ``hi``. They stand in
for a learned interval predictor until one exists.

- ``rough``: the same coarse ``[1, 1000]`` for everyone (Experiment 1);
- ``bins``: the bin of width 100 that holds ``o``: ``[1, 100], [101, 200], …,
  [901, 1000]`` (Experiment 2; a length past the last bin gets the next bin
  of the same width);
- ``overlap``: ``[(1 − x)·o, (1 + x)·o]``, ``x ∈ (0, 1)`` (Experiment 3). Its
  midpoint is ``o`` itself, so a policy reading ``point`` would see the truth.

``confidence`` is 1: by construction the interval holds the truth (for
``rough``, as long as ``o`` is within it).
"""

from __future__ import annotations

from duetime.core.request import Job, LengthPrediction


class RoughInterval:
    """One interval ``[lo, hi]`` for every request, whatever its length."""

    def __init__(self, lo: float = 1.0, hi: float = 1000.0) -> None:
        if not 0 <= lo <= hi:
            raise ValueError(f"rough interval needs 0 <= lo <= hi, got [{lo}, {hi}]")
        self.lo, self.hi = lo, hi
        self.name = f"interval:rough:{lo:g}:{hi:g}"

    def predict_job(self, job: Job) -> LengthPrediction:
        return LengthPrediction(point=(self.lo + self.hi) / 2, lo=self.lo, hi=self.hi)


class BinnedInterval:
    """The fixed-width bin ``[(b − 1)·w + 1, b·w]`` that contains the true length."""

    def __init__(self, width: int = 100) -> None:
        if width < 1:
            raise ValueError(f"bin width must be >= 1, got {width}")
        self.width = width
        self.name = f"interval:bins:{width}"

    def predict_job(self, job: Job) -> LengthPrediction:
        b = -(-job.output_len // self.width)  # ceil
        lo, hi = (b - 1) * self.width + 1, b * self.width
        return LengthPrediction(point=(lo + hi) / 2, lo=lo, hi=hi)


class OverlapInterval:
    """``[(1 − x)·o, (1 + x)·o]`` around the true length ``o``."""

    def __init__(self, x: float) -> None:
        if not 0 <= x < 1:
            raise ValueError(f"overlap width x must be in [0, 1), got {x}")
        self.x = x
        self.name = f"interval:overlap:{x:g}"

    def predict_job(self, job: Job) -> LengthPrediction:
        o = float(job.output_len)
        return LengthPrediction(point=o, lo=(1 - self.x) * o, hi=(1 + self.x) * o)


def make_interval_predictor(spec: str) -> RoughInterval | BinnedInterval | OverlapInterval:
    """``interval:rough[:lo:hi]``, ``interval:bins10``, ``interval:bins[:width]``,
    ``interval:overlap:<x>``."""
    parts = spec.split(":")
    kind, args = (parts[1] if len(parts) > 1 else ""), parts[2:]
    try:
        if kind == "rough" and len(args) in (0, 2):
            return RoughInterval(*(float(a) for a in args))
        if kind == "bins10" and not args:
            return BinnedInterval(100)
        if kind == "bins" and len(args) <= 1:
            return BinnedInterval(*(int(a) for a in args))
        if kind == "overlap" and len(args) == 1:
            return OverlapInterval(float(args[0]))
    except ValueError as e:
        raise ValueError(f"bad predictor {spec!r}: {e}") from None
    raise ValueError(
        f"unknown interval predictor {spec!r}; use interval:rough[:lo:hi], interval:bins10, "
        "interval:bins:<width> or interval:overlap:<x>"
    )
