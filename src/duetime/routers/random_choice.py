"""Random: a replica drawn uniformly from those that are up.

Source: Vidur's ``RandomGlobalScheduler`` (microsoft/vidur,
``vidur/scheduler/global_scheduler/random_global_scheduler.py``). Rule: uniform
over the up replicas, from a generator seeded once, so the same seed routes the
same way.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register


@register("random")
class RandomChoice:
    """Uniform over the up replicas, seeded (Vidur's random)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        up = snap.up_indices()
        return Route(int(up[self._rng.integers(len(up))]))
