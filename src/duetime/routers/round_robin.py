"""Round robin: each request to the next replica that is up, in turn.

Source: Vidur's ``RoundRobinGlobalScheduler`` (microsoft/vidur,
``vidur/scheduler/global_scheduler/round_robin_global_scheduler.py``). Rule:
replica ``k mod n`` for the ``k``-th request, skipping replicas that are down.
Blind to load, so it is the baseline every other router must beat; with one
replica it is no router at all, which is how the fleet is checked against the
single-engine simulator.
"""

from __future__ import annotations

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register


@register("round-robin")
class RoundRobin:
    """Replica k mod n for the k-th request, skipping replicas that are down."""

    name = "round-robin"

    def __init__(self, seed: int = 0) -> None:
        self._next = 0

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        n = snap.n
        up = snap.up
        for step in range(n):
            i = (self._next + step) % n
            if up[i]:
                self._next = i + 1
                return Route(i)
        raise AssertionError("the fleet asks a router only while a replica is up")
