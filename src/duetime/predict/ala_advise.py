"""Batch-size advice from a throughput model: the largest batch that meets a deadline.

ALA predicts the throughput of ``bb`` requests of one shape run together; the
batch then finishes in ``wall(bb) = bb·oo / thpt(bb)`` seconds. A larger batch
has more throughput but every request in it waits for the whole batch, which is
TimelyLLM's latency-guided batch-size trade-off (and the capacity-planning
question ALA was built for). The advice uses the interval, not only the point:
``bb_safe`` is the largest batch whose *pessimistic* wall (the interval's low
throughput) meets the deadline, ``bb_expected`` the largest whose point estimate
does. Throughput curves rise with bb, so wall(bb) is evaluated for every bb up
to ``max_batch`` rather than assumed monotonic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duetime.predict.ala_limits import MAX_BATCH, check_shape
from duetime.predict.ala_model import ThroughputPredictor


@dataclass(frozen=True, slots=True)
class BatchOption:
    """One batch size: predicted throughput (tok/s, with interval) and wall time (s)."""

    bb: int
    thpt_tok_s: float
    thpt_lo_tok_s: float
    thpt_hi_tok_s: float
    wall_s: float
    wall_hi_s: float
    confidence: float


def batch_options(
    predictor: ThroughputPredictor, ii: int, oo: int, max_batch: int
) -> list[BatchOption]:
    """Every bb in 1..max_batch with its predicted throughput and batch wall time."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch (--max-batch) must be in [1, {MAX_BATCH:,}], got {max_batch}")
    check_shape(ii, oo, 1)  # a bad length fails before the loop, not in it
    opts = []
    for bb in range(1, max_batch + 1):
        p = predictor.predict_throughput(ii, oo, bb)
        work = bb * oo
        opts.append(
            BatchOption(
                bb=bb,
                thpt_tok_s=p.point,
                thpt_lo_tok_s=p.lo,
                thpt_hi_tok_s=p.hi,
                wall_s=work / p.point if p.point > 0 else float("inf"),
                wall_hi_s=work / p.lo if p.lo > 0 else float("inf"),
                confidence=p.confidence,
            )
        )
    return opts


def advise_batch(
    predictor: ThroughputPredictor, ii: int, oo: int, deadline_s: float, max_batch: int = 256
) -> dict[str, object]:
    """``bb_safe`` / ``bb_expected`` (None when even bb = 1 misses) and the options table."""
    if not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ValueError(f"--deadline must be finite and > 0 s, got {deadline_s}")
    opts = batch_options(predictor, ii, oo, max_batch)
    safe = [o for o in opts if o.wall_hi_s <= deadline_s]
    expected = [o for o in opts if o.wall_s <= deadline_s]
    best_safe = max(safe, key=lambda o: o.bb) if safe else None
    best_exp = max(expected, key=lambda o: o.bb) if expected else None
    return {
        "ii": ii,
        "oo": oo,
        "deadline_s": deadline_s,
        "max_batch": max_batch,
        "bb_safe": best_safe.bb if best_safe else None,
        "bb_expected": best_exp.bb if best_exp else None,
        "safe": best_safe,
        "expected": best_exp,
        "options": opts,
    }
