"""N simulated replicas behind one router, driven by one event heap.

The heap holds, for each replica, the time of its next scheduling point (the end
of its step, or of its planned decode run: ``sim/replica.py``); arrivals come
from the sorted job list and failures from a sorted list. The loop takes the
earliest: a failure first, then an arrival (so a request arriving as a step ends
is seen by that step's next scheduling point, as in the single-engine loop),
then a replica. An arrival builds a :class:`~duetime.core.router.FleetSnapshot`
from arrays the replicas keep up to date after every tick, asks the router, and
carries out its answer. Nothing else is touched per arrival, so the cost of a
request is the router's plus one replica's work.

A failed replica (``fail_at``) is out of the snapshot at once (``up`` False);
it ends the step it is running, then each request it held, and each one routed
to it and not yet taken in, is offered to the router again as of that time: a
replica (counted ``rerouted``; it starts over there, its arrival time kept), the
fleet queue, or a refusal (counted ``failed``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter

import numpy as np

from duetime.core.policy import Policy
from duetime.core.record import RequestRecord
from duetime.core.request import MAX_TIME_S, Job, Request
from duetime.core.router import (
    FleetSnapshot,
    Refuse,
    Route,
    Router,
    RouterError,
    Wait,
    bad_route,
)
from duetime.predict.oracle import JobPredictor
from duetime.sim.fleet_result import FleetResult, ReplicaSpec, replica_result
from duetime.sim.fleet_routes import RouteLog
from duetime.sim.fleet_view import forecast_finish, prefix_hit
from duetime.sim.gc_pause import gc_paused
from duetime.sim.replica import Replica, State
from duetime.sim.simulator import SimulationError, Simulator

__all__ = ["Fleet", "FleetResult", "ReplicaSpec"]

_DONE = State.DONE  # (a module constant: a lookup on the enum class costs more)


def _by_arrival(jobs: Iterable[Job]) -> tuple[list[Job], list[float]]:
    """The jobs in the order they arrive (arrival time, then id), and their arrival
    times. A workload is usually built in that order already: strictly increasing
    times are checked in one vectorised pass, and only jobs out of order (or tied)
    are sorted, which at a million jobs saves half a second of keyed sorting."""
    pending = list(jobs)
    arrivals = [job.request.arrival for job in pending]
    times = np.asarray(arrivals, dtype=float)
    if not bool(np.all(times[1:] > times[:-1])):
        pending.sort(key=attrgetter("request.arrival", "request.rid"))
        arrivals = [job.request.arrival for job in pending]
    return pending, arrivals


class Fleet:
    """Plays a list of jobs through a router onto simulated replicas."""

    def __init__(
        self,
        specs: Sequence[ReplicaSpec],
        policy: Callable[[], Policy],
        router: Router,
        *,
        predictor: JobPredictor | None = None,
        fail_at: Mapping[int, float] | None = None,
        max_time: float = math.inf,
    ) -> None:
        if not specs:
            raise ValueError("a fleet needs at least one replica")
        self.specs = list(specs)
        self.new_policy = policy
        self.router = router
        self.predictor = predictor
        n = len(specs)
        self.replicas = [
            Replica(i, Simulator(policy(), s.cost, s.config, predictor), max_time)
            for i, s in enumerate(specs)
        ]
        self.fail_at = dict(fail_at or {})
        for i, t in self.fail_at.items():
            if not 0 <= i < n:
                raise ValueError(f"--fail names replica {i}; the fleet has 0..{n - 1}")
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"replica {i}'s failure time must be finite and >= 0, got {t}")
        self.up = np.ones(n, dtype=bool)
        self.n_up = n
        self.running = np.zeros(n, dtype=np.int64)
        self.waiting = np.zeros(n, dtype=np.int64)
        self.outstanding = np.zeros(n, dtype=np.int64)
        self.kv_used = np.zeros(n, dtype=np.int64)
        self.kv_capacity = np.array([s.config.kv_capacity for s in specs], dtype=np.int64)
        # Replicas whose figures changed since the arrays were last written: written
        # when a router next looks (a replica often moves several times in between),
        # through memoryviews of the arrays (an item written through one costs a
        # third less than through numpy's indexing; the arrays see the same memory).
        self._stale: list[Replica] = []
        self._views = tuple(
            a.data for a in (self.running, self.waiting, self.outstanding, self.kv_used)
        )
        self.routes = RouteLog()
        self.refused: dict[int, str] = {}
        self.refusal_records: dict[int, RequestRecord] = {}
        self._orphans: set[int] = set()  # rids a failed replica held: offered again
        self.counters = {"routed": 0, "refused": 0, "rerouted": 0, "failed": 0, "waited": 0}
        self.router_calls = 0
        self._heap: list[tuple[float, int, int]] = []  # (time, replica, its epoch)
        self._queue: list[tuple[float, int, Job]] = []  # the fleet queue: (key, order, job)
        self._order = 0
        self.now = 0.0
        # One snapshot, updated for each question (routers keep none of it): the
        # request asked about, and the forecasts made for it so far.
        self._asked: Request | None = None
        self._forecasts: dict[int, float | None] = {}
        self._snap = FleetSnapshot(
            now=0.0,
            request=Request(rid=-1, arrival=0.0, prompt_len=1),
            up=self.up,
            running=self.running,
            waiting=self.waiting,
            kv_used=self.kv_used,
            kv_capacity=self.kv_capacity,
            prefix_lookup=self._prefix_hit,
            forecast_of=self._forecast,
            kept_outstanding=self.outstanding,
        )

    # --- the replicas' figures, kept in arrays for the snapshot ---------------------
    def _touch(self, rep: Replica) -> None:
        """The replica's figures changed: write them before a router next looks."""
        if not rep.stale:
            rep.stale = True
            self._stale.append(rep)

    def _refresh(self) -> None:
        """Write the figures of every replica that changed since the last question."""
        running, waiting, outstanding, kv_used = self._views
        for rep in self._stale:
            rep.stale = False
            i = rep.index
            if not rep.up and rep.state is _DONE:
                running[i] = waiting[i] = outstanding[i] = kv_used[i] = 0
                continue
            sim = rep.sim
            r = len(sim.running)
            w = len(sim.waiting) + len(sim.suspended) + len(rep.inbox)
            running[i] = r
            waiting[i] = w
            outstanding[i] = r + w
            kv_used[i] = sim.kv_used
        self._stale.clear()

    def _schedule(self, rep: Replica) -> None:
        """Put the replica's next scheduling point on the heap (if it has one)."""
        t = rep.next_time()
        if t is not None:
            heapq.heappush(self._heap, (t, rep.index, rep.epoch))

    # --- routing --------------------------------------------------------------------
    def _prefix_hit(self, i: int) -> int:
        assert self._asked is not None, "asked outside a question"
        return prefix_hit(self.replicas[i], self._asked)

    def _forecast(self, i: int) -> float | None:
        memo = self._forecasts
        if i not in memo:
            req = self._asked
            assert req is not None, "asked outside a question"
            memo[i] = forecast_finish(self.replicas[i], req, self._snap.now, self.new_policy)
        return memo[i]

    def _snapshot(self, job: Job, now: float) -> FleetSnapshot:
        """The fleet snapshot for ``job`` at ``now``: the one object, brought up to date."""
        if self._stale:
            self._refresh()
        if self._forecasts:
            self._forecasts = {}
        snap = self._snap
        snap.now = now
        snap.request = self._asked = job.request
        return snap

    def _route(self, job: Job, now: float, *, retry: bool = False) -> bool:
        """Ask the router about ``job`` at ``now`` and carry the answer out; False when
        it is to wait (a job already in the fleet queue stays where it is)."""
        rid = job.request.rid
        if not self.n_up:
            self._refuse(job, now, "every replica is down")
            return True
        self.router_calls += 1
        dec = self.router.route(self._snapshot(job, now))
        if type(dec) is Route or isinstance(dec, Route):
            i = dec.replica
            reps = self.replicas
            if type(i) is not int or not 0 <= i < len(reps):
                if (why := bad_route(i, len(reps))) is not None:
                    raise RouterError(f"router {self.router.name!r} chose {why}")
                i = int(i)  # a numpy integer
            rep = reps[i]
            # (``rep.up`` is ``self.up[i]``, kept beside it: a plain attribute reads faster)
            if not rep.up:
                raise RouterError(f"router {self.router.name!r} chose replica {i}, which is down")
            if self._orphans and rid in self._orphans:
                self.routes.again(rid, i)
                self.counters["rerouted"] += 1
            else:
                self.routes.first(rid, i)
                self.counters["routed"] += 1
            if rep.deliver(job, now):
                self._schedule(rep)
            self._touch(rep)
            return True
        if isinstance(dec, Wait):
            if not retry:
                self.counters["waited"] += 1
                heapq.heappush(self._queue, (dec.key, self._order, job))
                self._order += 1
            return False
        if isinstance(dec, Refuse):
            self._refuse(job, now, dec.reason)
            return True
        raise RouterError(f"router {self.router.name!r} answered {dec!r}")

    def _refuse(self, job: Job, now: float, reason: str) -> None:
        rid = job.request.rid
        self.counters["failed" if rid in self._orphans else "refused"] += 1
        self.refused[rid] = reason
        self.refusal_records[rid] = RequestRecord(
            request=job.request, cancelled_at=now, target_tokens=job.output_len
        )

    def _retry_queue(self, now: float) -> None:
        """Offer the fleet queue's requests again, smallest key first, until one waits."""
        queue = self._queue
        while queue:
            _, _, job = queue[0]
            if not self._route(job, now, retry=True):
                return
            heapq.heappop(queue)

    # --- failures -------------------------------------------------------------------
    def _fail(self, i: int, t: float) -> None:
        """Replica ``i`` fails at ``t``: out of routing now, gone at the end of its step."""
        rep = self.replicas[i]
        if not self.up[i]:
            return
        self.up[i] = False
        self.n_up -= 1
        rep.up = False
        rep.failing = True
        if rep.cut(t) or rep.state is State.DONE:
            rep.state = State.READY
            rep.epoch += 1
            self._schedule(rep)

    def _remove(self, rep: Replica) -> None:
        """The failed replica's step has ended: offer what it held to the router again."""
        now = rep.sim.now
        rep.state = State.DONE
        orphans = rep.in_flight()
        rep.inbox.clear()
        self._touch(rep)  # a failed replica's figures are written as zeros
        for job in orphans:
            self._orphans.add(job.request.rid)
            self._route(job, now)

    # --- main loop ------------------------------------------------------------------
    def run(
        self, jobs: Iterable[Job], progress: Callable[[int, int], None] | None = None
    ) -> FleetResult:
        """Simulate until every request ended, was refused, or the clock passed ``max_time``."""
        with gc_paused():
            return self._run(jobs, progress)

    def _run(self, jobs: Iterable[Job], progress: Callable[[int, int], None] | None) -> FleetResult:
        t0 = time.perf_counter()
        pending, arrivals = _by_arrival(jobs)
        n_jobs = len(pending)
        if n_jobs and not pending[-1].request.arrival <= MAX_TIME_S:
            raise SimulationError(
                f"request {pending[-1].request.rid} arrives past the "
                f"{MAX_TIME_S:.0e} s a run can time"
            )
        fails = sorted((t, i) for i, t in self.fail_at.items())
        heap = self._heap
        reps = self.replicas
        predictor = self.predictor
        # Both lists end in a sentinel at infinity, so the loop reads the next time of
        # each without a bounds test (it runs a few times per request).
        arrivals.append(math.inf)
        fails.append((math.inf, -1))
        inf = math.inf
        heappop, heappush = heapq.heappop, heapq.heappush
        stale = self._stale
        i = f = 0
        t_fail = fails[0][0]
        shown = 0
        while True:
            t_arr = arrivals[i]
            while heap and heap[0][2] != reps[heap[0][1]].epoch:
                heappop(heap)  # a plan an arrival or failure cut short
            t_rep = heap[0][0] if heap else inf
            if t_arr == inf and t_rep == inf:
                break  # a failure after the last event: it moved the clock, nothing else
            if t_fail <= t_arr and t_fail <= t_rep:
                self.now = t_fail
                self._fail(fails[f][1], t_fail)
                f += 1
                t_fail = fails[f][0]
            elif t_arr <= t_rep and t_arr < inf:
                job = pending[i]
                i += 1
                self.now = t_arr
                if predictor is not None and job.request.predicted is None:
                    job.request.predicted = predictor.predict_job(job)
                self._route(job, t_arr)
            else:
                _, r, _ = heappop(heap)
                rep = reps[r]
                rep.epoch += 1
                sim = rep.sim
                done = sim.n_done
                rep.take_planned()
                if sim.now > self.now:
                    self.now = sim.now
                if rep.failing:
                    self._remove(rep)
                    continue
                rep.tick()
                if not rep.stale:  # (_touch, written out)
                    rep.stale = True
                    stale.append(rep)
                t = rep.next_time()  # (_schedule, written out)
                if t is not None:
                    heappush(heap, (t, r, rep.epoch))
                if self._queue and sim.n_done != done:
                    self._retry_queue(sim.now)
            if progress is not None and i - shown >= 1000:
                shown = i
                progress(i, n_jobs)
        self._end_queue()
        stuck = [r.index for r in reps if r.state is State.STUCK]
        if stuck:
            name = reps[stuck[0]].sim.policy.name
            raise SimulationError(
                f"policy {name!r} scheduled nothing on replica {stuck[0]} with requests "
                "waiting and no future event: the run would never end"
            )
        if progress is not None:
            progress(n_jobs, n_jobs)
        return self._result(pending, time.perf_counter() - t0)

    def _end_queue(self) -> None:
        """Requests still in the fleet queue when nothing else can happen are refused."""
        while self._queue:
            _, _, job = heapq.heappop(self._queue)
            self._refuse(job, self.now, "still waiting in the fleet queue when the run ended")

    def _result(self, pending: list[Job], wall_s: float) -> FleetResult:
        records: list[RequestRecord] = []
        reps = self.replicas
        kept = [r.sim.records for r in reps]
        refusals = self.refusal_records
        last = self.routes.last_replicas()
        for job in pending:
            rid = job.request.rid
            rec = refusals.get(rid) if refusals else None  # a refusal is final
            if rec is None:
                owner = last.get(rid)
                if owner is not None:
                    rec = kept[owner].get(rid)
            if rec is not None:
                records.append(rec)
        per = [replica_result(r) for r in reps]
        return FleetResult(
            records=records,
            replicas=per,
            names=[s.name for s in self.specs],
            routes=self.routes,
            refused=self.refused,
            counters=dict(self.counters),
            sim_time=max((r.sim.now for r in reps), default=0.0),
            wall_s=wall_s,
            router_calls=self.router_calls,
            failed_replicas=sorted(i for i, r in enumerate(reps) if not r.up),
        )
