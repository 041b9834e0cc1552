"""What a fleet run is built from and what it returns: each replica's spec, the
fleet's result, and a replica's own result as the single-engine simulator reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from duetime.core.cost import LinearStepCost
from duetime.core.record import RequestRecord
from duetime.sim.fleet_routes import RouteLog
from duetime.sim.replica import Replica
from duetime.sim.simulator import SimConfig, SimResult


@dataclass(slots=True)
class ReplicaSpec:
    """One replica's engine: its step-cost model and limits, and a name for tables."""

    cost: LinearStepCost
    config: SimConfig
    name: str = "replica"


@dataclass(slots=True)
class FleetResult:
    """The fleet's records (one per request: where it ended, or its refusal), each
    replica's own result, and counts of what the router decided.

    ``routes[rid]`` lists the replicas a request was sent to, in order (more than one
    only after a failure); ``refused[rid]`` is the refusal's reason for a request
    that never ran to its end because the router turned it away."""

    records: list[RequestRecord]
    replicas: list[SimResult]
    names: list[str]
    routes: RouteLog
    refused: dict[int, str]
    counters: dict[str, int]
    sim_time: float
    wall_s: float
    router_calls: int
    failed_replicas: list[int] = field(default_factory=list)

    @property
    def engine_steps(self) -> int:
        return sum(r.engine_steps for r in self.replicas)


def replica_result(rep: Replica) -> SimResult:
    """The replica's counters as a :class:`SimResult`; its records are those it ended."""
    sim = rep.sim
    recs = [
        r
        for r in sim.records.values()
        if rep.up or r.finish is not None or r.cancelled_at is not None
    ]
    return sim.result(sorted(recs, key=attrgetter("request.arrival", "request.rid")), 0.0)
