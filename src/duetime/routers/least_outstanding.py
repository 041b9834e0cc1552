"""Least outstanding requests (LOR): the replica holding the fewest requests.

Source: Vidur's ``LORGlobalScheduler`` (microsoft/vidur,
``vidur/scheduler/global_scheduler/lor_global_scheduler.py``), the classic
join-the-shortest-queue. Rule: the up replica with the smallest running +
waiting count; ties go to the lowest index. It counts requests, not work: a
replica with three long answers looks as free as one with three short ones, and
a slow replica as free as a fast one.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register

_BIG = np.iinfo(np.int64).max


def least(values: np.ndarray, up: np.ndarray) -> int:
    """Index of the smallest value among up replicas (the lowest index on ties)."""
    i = int(values.argmin())  # the first smallest of all: when it is up, it is the
    if up[i]:  # first smallest among the up ones too (a lower up one would be first)
        return i
    return int(np.where(up, values, _BIG).argmin())


@register("lor")
class LeastOutstanding:
    """Fewest running + waiting; lowest index on ties (Vidur's LOR)."""

    name = "lor"

    def __init__(self, seed: int = 0) -> None:
        pass

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        return Route(least(snap.outstanding, snap.up))
