"""Shortest queue: the replica with the fewest requests waiting to start.

Source: llm-d's ``queue-scorer`` (llm-d/llm-d-inference-scheduler,
``pkg/plugins/scorer/queue.go``: score falls linearly with the waiting-queue
length). Rule: the up replica with the fewest waiting requests; ties (common:
an unsaturated replica queues nothing) go to the fewest running, then the
lowest index. Unlike LOR it ignores the running batch until a replica queues.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register


@register("shortest-queue")
class ShortestQueue:
    """Fewest waiting; then fewest running (llm-d's queue scorer)."""

    name = "shortest-queue"

    def __init__(self, seed: int = 0) -> None:
        pass

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        big = np.iinfo(np.int64).max
        waiting = np.where(snap.up, snap.waiting, big)
        order = np.lexsort((np.arange(snap.n), snap.running, waiting))
        return Route(int(order[0]))
