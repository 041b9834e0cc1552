"""Power of two choices: two replicas at random, the less loaded of the two.

Source: M. Mitzenmacher, "The Power of Two Choices in Randomized Load
Balancing", IEEE TPDS 12(10), 2001. Rule: draw two distinct up replicas
uniformly (seeded), send to the one with fewer outstanding requests (the first
drawn on a tie). Nearly as even as LOR while reading two replicas' counts, not
all of them: what a router that cannot see the whole fleet at once can do.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register


@register("power-of-two")
class PowerOfTwo:
    """Two distinct up replicas at random, the one with fewer outstanding."""

    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        up = snap.up_indices()
        if len(up) == 1:
            return Route(int(up[0]))
        a, b = (int(up[k]) for k in self._rng.choice(len(up), size=2, replace=False))
        load = snap.outstanding
        return Route(a if load[a] <= load[b] else b)
