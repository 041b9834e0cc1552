"""The seam between a fleet of replicas and the request that just arrived.

A router is to a fleet what a :class:`~duetime.core.policy.Policy` is to one
engine: it maps a :class:`FleetSnapshot` to a plain-data answer, never reads
the wall clock (``snap.now`` is the time) and never learns whether the replicas
are simulated (``sim/fleet.py``) or real engines behind a gateway. Whoever runs
the fleet builds the snapshot and carries out the answer.

The answer is one of three: :class:`Route` (send it to that replica),
:class:`Wait` (hold it in the fleet queue, ordered by a key, and ask again when
a replica frees room) or :class:`Refuse` (tell the client now, with a reason and
when to try again). The per-replica figures are numpy arrays indexed by replica,
so a router over 64 replicas decides in a few microseconds: at a million
requests, every microsecond a decision costs is a second of wall time.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from duetime.core.request import Request

__all__ = [
    "FleetSnapshot",
    "Refuse",
    "Route",
    "RouteDecision",
    "Router",
    "RouterError",
    "Wait",
]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class RouterError(RuntimeError):
    """A router answered something the fleet cannot carry out (a replica that is down)."""


def bad_route(replica: object, n: int) -> str | None:
    """Why ``Route(replica)`` names none of ``n`` replicas, in words that follow "chose"
    (None: it names one; whether that one is up is the fleet's to say)."""
    if isinstance(replica, bool) or not isinstance(replica, numbers.Integral):
        return f"replica {replica!r}: a Route takes a replica's index, an int"
    if not 0 <= int(replica) < n:
        return f"replica {replica}, and the fleet has 0..{n - 1}"
    return None


@dataclass(slots=True, frozen=True)
class Route:
    """Send the request to replica ``replica`` (an index into the snapshot's arrays)."""

    replica: int


@dataclass(slots=True, frozen=True)
class Wait:
    """Hold the request in the fleet queue; the smallest ``key`` is asked about first,
    each time a request ends somewhere in the fleet."""

    key: float


@dataclass(slots=True, frozen=True)
class Refuse:
    """Turn the request away now: ``reason`` for the client, ``retry_after_s`` to wait."""

    reason: str
    retry_after_s: float = 1.0


RouteDecision = Route | Wait | Refuse


@dataclass(slots=True)
class FleetSnapshot:
    """The fleet as a router sees it when ``request`` asks for a replica. Read-only.

    Arrays have one entry per replica, in a fixed order: ``up`` (False once a
    replica failed: never route there), ``running`` (sequences holding a batch
    slot), ``waiting`` (queued on the replica, suspended ones included, and those
    routed there that it has not yet taken in), ``kv_used`` / ``kv_capacity``
    (KV tokens), and :attr:`outstanding` (running plus waiting, Vidur's LOR count:
    most routers rank by it, so a fleet keeps it, ``kept_outstanding``, rather than
    have each router add the two arrays per request). They are the fleet's live
    arrays, not copies: never mutate them. A fleet may hand the same snapshot
    object, updated, to its next question: a router reads it during ``route`` and
    keeps none of it.

    Two figures cost more than a lookup and are computed only when asked for:
    :meth:`prefix_hit` (prompt tokens of ``request`` the replica's prefix cache
    holds now) and :meth:`forecast` (when ``request`` would finish there: the
    replica's engine image played forward under its policy and cost model, by
    the same ``sim/forecast.py`` the server's admission runs). ``forecast``
    answers None where the request would not finish within the forecast's
    horizon.
    """

    now: float
    request: Request
    up: BoolArray
    running: IntArray
    waiting: IntArray
    kv_used: IntArray
    kv_capacity: IntArray
    prefix_lookup: Callable[[int], int]
    forecast_of: Callable[[int], float | None]
    kept_outstanding: IntArray | None = None  # running + waiting, where the fleet keeps it

    @property
    def n(self) -> int:
        """How many replicas the fleet has (down ones included)."""
        return len(self.up)

    @property
    def outstanding(self) -> IntArray:
        """Requests each replica holds: running plus waiting (Vidur's LOR count)."""
        kept = self.kept_outstanding
        return self.running + self.waiting if kept is None else kept

    def up_indices(self) -> IntArray:
        """Indices of the replicas that are up, ascending."""
        return np.flatnonzero(self.up)

    def prefix_hit(self, replica: int) -> int:
        """Prompt tokens of the request whose KV ``replica``'s prefix cache holds now."""
        return self.prefix_lookup(replica)

    def forecast(self, replica: int) -> float | None:
        """Absolute time the request would finish on ``replica`` (None: not in the horizon)."""
        return self.forecast_of(replica)


@runtime_checkable
class Router(Protocol):
    """Chooses where a request goes. Only replicas that are ``up`` may be chosen; the
    fleet refuses on its own when none is up, so a router always sees one."""

    name: str

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        """Decide for ``snap.request`` now."""
        ...
