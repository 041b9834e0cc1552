"""One replica of a simulated fleet: a :class:`Simulator` stepped by the fleet's heap.

:meth:`Simulator.run` is a loop that knows every arrival in advance, so it can
stop a decode run at the next one. In a fleet an arrival's replica is known only
when it arrives (the router decides then, from the replicas' state), so each
replica runs the same loop body one scheduling point at a time (:meth:`tick`)
and *plans* its next decode run up to its own next event (a stop, memory
running out, a timer, the policy's wake-up) without taking it. The run is taken
when the fleet's heap reaches its end, or, if a request is routed here first,
planned again up to that arrival and taken then (:meth:`cut`): exactly the run
the single-engine loop takes, whose horizon is the next arrival. So event
skipping still holds per replica, an arrival disturbs only the replica it is
routed to, and one replica reproduces ``Simulator.run`` record for record.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from enum import Enum

from duetime.core.request import Job
from duetime.sim.simulator import SimulationError, Simulator


class State(Enum):
    """What a replica does until the fleet next wakes it."""

    READY = 0  # its last step ended at ``sim.now``: tick there
    DECODE = 1  # a planned decode run of ``planned`` steps, not yet taken
    IDLE = 2  # nothing to run until ``horizon`` (a timer, a wake-up)
    ASLEEP = 3  # nothing in the system: woken by the next request routed here
    STUCK = 4  # work it will not schedule and no event of its own: needs an arrival
    DONE = 5  # its clock passed the run's end, or it failed


# The members as module constants: the loop below reads a replica's state a few times
# per request, and on CPython 3.11 ``State.READY`` (a lookup on the enum's class)
# costs about 65 ns where a module global costs about 10.
_READY = State.READY
_DECODE = State.DECODE
_IDLE = State.IDLE
_ASLEEP = State.ASLEEP
_STUCK = State.STUCK
_DONE = State.DONE


class Replica:
    """A simulator, its inbox of routed requests and the plan of its next event."""

    __slots__ = (
        "epoch",
        "failing",
        "horizon",
        "idle_calls",
        "inbox",
        "index",
        "max_time",
        "planned",
        "sim",
        "span",
        "stale",
        "state",
        "up",
        "wake",
    )

    def __init__(self, index: int, sim: Simulator, max_time: float = math.inf) -> None:
        self.index = index
        self.sim = sim
        self.inbox: deque[tuple[float, Job]] = deque()  # (routed at, job), in routing order
        self.state = _ASLEEP
        self.planned = 0  # steps of the planned decode run
        self.span: float | None = None  # its seconds, once asked (taking it needs them)
        self.horizon = math.inf  # the replica's own next event
        self.wake = math.inf  # the policy's last wake_at
        self.epoch = 0  # bumped whenever the time the heap holds for it goes stale
        self.idle_calls = 0
        self.up = True
        self.failing = False  # failed: removed from the fleet at its next tick
        self.stale = False  # its figures changed since the fleet's arrays last took them
        self.max_time = max_time

    # --- what the fleet reads -------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Queued here, suspended, or routed and not yet taken in."""
        sim = self.sim
        return len(sim.waiting) + len(sim.suspended) + len(self.inbox)

    def next_time(self) -> float | None:
        """When the fleet must next tick this replica (None: only an arrival wakes it)."""
        state = self.state
        if state is _READY:
            return self.sim.now
        if state is _DECODE:
            sim = self.sim
            self.span = span = sim._decode_span_s(self.planned)
            return sim._decode_end(self.planned, span)
        if state is _IDLE:
            return self.sim.now + max(self.horizon - self.sim.now, 0.0)
        return None

    # --- what the fleet does to it ----------------------------------------------------
    def deliver(self, job: Job, now: float) -> bool:
        """A request routed here at ``now``: take the planned work up to ``now``. True
        when the replica's next scheduling point changed (the fleet re-queues it)."""
        self.inbox.append((now, job))
        return self.cut(now)

    def cut(self, t: float) -> bool:
        """Bring the replica to its first scheduling point at or after ``t``, as the
        single-engine loop would with an event at ``t``; False when it already was
        (its step ends then, or it is done)."""
        sim = self.sim
        state = self.state
        if state is _DECODE:
            sim._decode_apply(sim._decode_plan(min(self.horizon, t)))
        elif state is _IDLE or state is _STUCK:
            sim._advance(max(min(self.horizon, t) - sim.now, 0.0))
        elif state is _ASLEEP:
            sim.now = max(sim.now, t)
        else:
            return False
        self.state = _READY
        self.epoch += 1
        return True

    def take_planned(self) -> None:
        """The heap reached the planned event: take it (then :meth:`tick`)."""
        state = self.state
        if state is _DECODE:
            self.sim._decode_apply(self.planned, self.span)  # (planned, then left alone)
        elif state is _IDLE:
            sim = self.sim
            sim._advance(max(self.horizon - sim.now, 0.0))
        self.state = _READY

    def tick(self) -> None:
        """One pass of the single-engine loop's body at ``sim.now``: take in what was
        routed here by now, ask the policy, run a step or plan a run."""
        sim = self.sim
        now = sim.now
        inbox = self.inbox
        while inbox and inbox[0][0] <= now:
            sim.admit_arrival(inbox.popleft()[1])
        timers = sim._timers
        if timers:
            while timers and timers[0] <= now:
                heapq.heappop(timers)
            own = timers[0] if timers else math.inf
        else:
            own = math.inf
        wake = self.wake
        if wake <= now:
            self.wake = wake = math.inf
        if wake < own:
            own = wake
        if not sim.running and not sim.waiting and not sim.suspended:
            self.state = _ASLEEP
            return
        if now >= self.max_time:
            self.state = _DONE
            return
        dec = sim.policy.schedule(sim.snapshot())
        sim.policy_calls += 1
        wake_at = dec.wake_at
        if wake_at is not None and wake_at > now:
            self.wake = min(self.wake, wake_at)
            own = min(own, self.wake)
        chunks = sim._apply(dec)
        sim._check_limits(chunks, dec.prefill_only)
        if chunks or sim._n_dec:
            self.idle_calls = 0
        self.horizon = own if own < self.max_time else self.max_time
        if chunks:
            sim._prefill_step(chunks, dec.prefill_only)
            self.state = _READY
        elif sim._n_dec:
            self.planned = sim._decode_plan(self.horizon)
            self.span = None
            self.state = _DECODE
        elif sim._pending_swap or sim._pending_evict_s:
            sim._prefill_step([])
            self.state = _READY
        elif not dec.is_empty():
            self.idle_calls += 1
            if self.idle_calls > 10_000:
                raise SimulationError(
                    f"policy {sim.policy.name!r} changed state 10,000 times "
                    "without letting the engine run a step"
                )
            self.state = _READY
        else:
            self.horizon = own  # the single-engine loop idles to its next event, uncapped
            self.state = _IDLE if own < math.inf else _STUCK

    def in_flight(self) -> list[Job]:
        """Every request routed here that has not ended, in routing order."""
        sim = self.sim
        jobs = [
            sim._jobs[rid]
            for rid, rec in sim.records.items()
            if rec.finish is None and rec.cancelled_at is None
        ]
        return jobs + [job for _, job in self.inbox]
