"""Earliest deadline first.

The waiting queue is ordered by absolute deadline (requests without one go
last, in arrival order); on memory pressure the running sequence with the
latest deadline is preempted first. Admission does not stop at a request that
does not fit: a later, smaller one with a later deadline may still go, since
holding memory idle helps no deadline.
"""

from __future__ import annotations

import math
from typing import Any

from duetime.core.sequence import Seq
from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register


def _deadline(seq: Seq) -> float:
    d = seq.req.deadline
    return math.inf if d is None else d


@register("edf")
class EDF(QueuePolicy):
    """Order by deadline; preempt the latest deadline first."""

    name = "edf"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("head_of_line_blocking", False)
        super().__init__(**kwargs)

    def waiting_key(self, seq: Seq) -> Any:
        return (_deadline(seq), seq.req.arrival)

    def victim_key(self, seq: Seq, now: float) -> Any:
        return (_deadline(seq), seq.order)
