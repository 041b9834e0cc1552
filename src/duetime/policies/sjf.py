"""Shortest job first, on predicted output length.

``spf`` (shortest predicted first) orders the waiting queue by the request's
predicted output length (``Request.predicted.point``) and preempts the
sequence with the most predicted work left. ``sjf`` is the same policy meant
to run with the oracle predictor: it is the hindsight bound, not something a
real server can do. Neither ever reads the hidden true length; they read
whatever predictor the executor was given.
"""

from __future__ import annotations

import math
from typing import Any

from duetime.core.sequence import Seq
from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register


def predicted_remaining(seq: Seq) -> float:
    """Predicted output tokens still to generate (inf when unpredicted)."""
    p = seq.req.predicted
    if p is None:
        return math.inf
    return max(p.point - seq.generated, 0.0)


@register("spf")
class ShortestPredictedFirst(QueuePolicy):
    """Order by predicted length; preempt the longest predicted remainder first."""

    name = "spf"
    default_predictor: str | None = "noisy"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("head_of_line_blocking", False)
        super().__init__(**kwargs)

    def waiting_key(self, seq: Seq) -> Any:
        p = seq.req.predicted
        return (math.inf if p is None else p.point, seq.req.arrival)

    def victim_key(self, seq: Seq, now: float) -> Any:
        return (predicted_remaining(seq), seq.order)


@register("sjf")
class OracleShortestJobFirst(ShortestPredictedFirst):
    """SJF with the oracle predictor: the hindsight reference."""

    name = "sjf"
    default_predictor: str | None = "oracle"
