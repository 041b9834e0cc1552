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


def deadline_of(seq: Seq) -> float:
    """A sequence's absolute deadline, ``math.inf`` without one: the order of EDF's queue
    and victims (and of TimeBill's, which keeps EDF's) puts those requests last."""
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
        return (deadline_of(seq), seq.req.arrival)

    def victim_key(self, seq: Seq, now: float) -> Any:
        return (deadline_of(seq), seq.order)
