"""Least KV use: the replica whose KV cache is least full.

Source: llm-d's ``kv-cache-utilization-scorer`` (llm-d/llm-d-inference-scheduler,
``pkg/plugins/scorer/kvcache_utilization.go``: score = 1 − KV use). Rule: the up
replica with the smallest ``kv_used / kv_capacity``; ties (an idle fleet) go to
the fewest outstanding requests, then the lowest index. A fraction, so a replica
with twice the memory takes twice the load before it looks as full.
"""

from __future__ import annotations

import numpy as np

from duetime.core.router import FleetSnapshot, Route, RouteDecision
from duetime.routers.registry import register


@register("least-kv")
class LeastKV:
    """Smallest share of KV in use; then fewest outstanding (llm-d's kv-cache scorer)."""

    name = "least-kv"

    def __init__(self, seed: int = 0) -> None:
        pass

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        use = snap.kv_used / snap.kv_capacity
        load = snap.outstanding
        # np.lexsort sorts by its last key first: use, then load, then index
        order = np.lexsort((np.arange(snap.n), load, np.where(snap.up, use, np.inf)))
        return Route(int(order[0]))
