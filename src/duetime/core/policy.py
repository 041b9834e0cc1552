"""The seam between scheduling and execution.

A policy maps an :class:`EngineSnapshot` to a :class:`Decision`. It never reads
the wall clock (``snap.now`` is the time) and never learns which executor runs
it: the simulator and the real engine build the same snapshot and carry out
the same decision. That is what lets a user simulate 100k requests, then serve
real ones with identical code.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from duetime.core.decision import Decision
from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot


class PolicyError(RuntimeError):
    """A policy returned a decision the executor cannot carry out."""


@runtime_checkable
class Policy(Protocol):
    """A scheduling policy.

    ``waiting_key`` orders the waiting queue (smallest first). It is evaluated
    once, when a sequence enters the queue, so it must not depend on time;
    executors keep the queue sorted by it, and ``snap.waiting`` arrives in that
    order. Time-dependent priorities (TimelyLLM's PUD) are computed inside
    ``schedule``.

    ``default_predictor`` names the length predictor the policy is meant to run
    with (``"oracle"`` for oracle SJF, ``None`` when it needs none).

    Two methods are optional (executors look them up; every built-in policy has
    them through ``QueuePolicy``): ``forget(rid)`` drops what is kept for a
    request that is gone, and ``fork()`` returns a copy that carries the private
    state on without sharing it, which a forecast runs from the engine's image.
    """

    name: str
    default_predictor: str | None

    def waiting_key(self, seq: Seq) -> Any:
        """Sort key of a sequence in the waiting queue."""
        ...

    def schedule(self, snap: EngineSnapshot) -> Decision:
        """Decide what to do now."""
        ...
