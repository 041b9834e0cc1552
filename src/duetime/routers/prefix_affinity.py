"""Prefix affinity with a load cap: the replica that caches most of the prompt,
unless it is already much busier than the least busy one.

Source: llm-d's ``prefix-cache-scorer`` (llm-d/llm-d-inference-scheduler,
``pkg/plugins/scorer/prefix``: score = share of the prompt's blocks the replica
caches), combined as llm-d's default profile does with a load scorer. Rule:
among up replicas whose outstanding requests are at most ``cap`` above the
fleet's least, the one whose prefix cache holds most of the prompt; ties go to
the fewest outstanding, then the lowest index. The cap keeps one hot system
prompt from piling every request onto one replica.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register

DEFAULT_CAP = 8


@register("prefix-affinity")
class PrefixAffinity:
    """Most prompt tokens cached, among replicas not far above the least loaded."""

    name = "prefix-affinity"

    def __init__(self, seed: int = 0, cap: int = DEFAULT_CAP) -> None:
        if cap < 0:
            raise ValueError(f"prefix-affinity cap must be >= 0 requests, got {cap}")
        self.cap = cap

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        load = snap.outstanding
        up = snap.up
        floor = int(load[up].min())
        best, best_key = -1, (0, 0, 0)
        for i in np.flatnonzero(up & (load <= floor + self.cap)).tolist():
            key = (-snap.prefix_hit(i), int(load[i]), i)
            if best < 0 or key < best_key:
                best, best_key = i, key
        return Route(best)
