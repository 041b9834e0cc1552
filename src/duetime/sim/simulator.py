"""Iteration-level discrete-event simulator.

The loop reads like an engine step (nano-vllm): admit arrivals → ask the
policy → apply its decision → run a step. The speed comes from one fact: between
two events (an arrival, a sequence reaching its stop, memory running out, a
timer) every decode step has the same batch, so k steps are one arithmetic
series (:meth:`LinearStepCost.decode_span`) and are taken at once. Decoding
sequences are never touched per step either: they read their token counts off
the shared :class:`DecodeClock` (see ``core/sequence.py``); the simulator
keeps only running sums.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from duetime.core.cost import CostModel, LinearStepCost
from duetime.core.executor import ExecutorCore, ExecutorError
from duetime.core.policy import Policy
from duetime.core.record import RequestRecord
from duetime.core.request import MAX_TIME_S, Job
from duetime.core.sequence import Seq
from duetime.predict.oracle import JobPredictor

SimulationError = ExecutorError  # the simulator's name for it


@dataclass(slots=True)
class SimConfig:
    """Engine limits the simulator enforces. KV capacity is in tokens."""

    kv_capacity: int = 110_000
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    max_time: float = math.inf  # stop the clock here (unfinished requests stay unfinished)
    offload_suspended: bool = False  # page suspended KV out under pressure (TimelyLLM §4.1)
    # Automatic prefix caching (core/prefix_cache.py), its own budget in tokens; 0: off.
    prefix_cache_tokens: int = 0
    # Prompt tokens a hit leaves to compute: 1 (vLLM), or 32 to model the engine under SnapKV.
    prefix_compute_tail: int = 1
    # Prefills of one step that start with the same tokens compute them once (as the engine).
    share_prefills: bool = True

    def check(self) -> None:
        """Refuse limits no engine has (a negative KV capacity rejects every request)."""
        for name in ("kv_capacity", "max_num_seqs", "max_batch_tokens", "prefix_compute_tail"):
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.prefix_cache_tokens >= 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")


@dataclass(slots=True)
class SimResult:
    """Records of every request plus counters of what the simulator did."""

    records: list[RequestRecord]
    sim_time: float
    engine_steps: int
    decode_steps: int
    policy_calls: int
    preemptions: int
    wall_s: float
    kv_peak: int
    tokens_generated: int = 0
    mean_in_system: float = 0.0
    mean_running: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


class Simulator(ExecutorCore):
    """Plays a list of jobs through a policy on a modelled engine."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        config: SimConfig | None = None,
        predictor: JobPredictor | None = None,
    ) -> None:
        self.cfg = config or SimConfig()
        self.cfg.check()
        super().__init__(
            policy,
            kv_capacity=self.cfg.kv_capacity,
            max_num_seqs=self.cfg.max_num_seqs,
            max_batch_tokens=self.cfg.max_batch_tokens,
            predictor=predictor,
            offload_suspended=self.cfg.offload_suspended,
            prefix_cache_tokens=self.cfg.prefix_cache_tokens,
            prefix_compute_tail=self.cfg.prefix_compute_tail,
            share_prefills=self.cfg.share_prefills,
        )
        self.cost = cost
        self._pending_evict_s = 0.0  # eviction work the next step pays (cost.eviction_time)
        self._area = 0.0  # ∫ (requests in system) dt, measured independently of the records
        self._area_run = 0.0  # ∫ (running sequences) dt

    def step_cost_model(self) -> LinearStepCost | None:
        return self.cost if isinstance(self.cost, LinearStepCost) else None

    def _on_evict(self, seq: Seq, n_tokens: int, alpha: float) -> None:
        evict = getattr(self.cost, "eviction_time", None)
        if evict is not None:
            self._pending_evict_s += evict(seq.kv_tokens)  # the KV it held before eviction

    def _advance(self, dt: float) -> None:
        if self._pending_evict_s:
            dt += self._pending_evict_s
            self._pending_evict_s = 0.0
        n_run = len(self.running)
        self._area += (n_run + len(self.waiting) + len(self.suspended)) * dt
        self._area_run += n_run * dt
        self.now += dt

    def _prefill_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> None:
        """One step with prefill chunks (and every decoder taking one token, unless they
        hold: ``prefill_only``)."""
        p_tokens = 0.0
        attn = 0.0
        lent = self.borrowed
        for seq, n in chunks:
            rows = self.computed_rows(seq, n) if lent else n
            p_tokens += rows
            attn += self.cost.chunk_attention(rows, seq.prefilled + n)
        swap = self._pending_swap
        self._pending_swap = 0
        n_dec, kv = (0, 0) if prefill_only else (self._n_dec, self._dec_kv())
        if n_dec and self._ride:  # the decoders' forced runs ride along (Job.ride_rows)
            p_tokens += self._ride  # (a share of each run: a fraction)
        self._advance(self.cost.step_time(p_tokens, attn, n_dec, kv, swap))
        self._after_step(chunks, prefill_only)

    def _decode_run(self, horizon_time: float) -> None:
        """Advance pure-decode steps up to the next event."""
        self._decode_apply(self._decode_plan(horizon_time))

    def _decode_plan(self, horizon_time: float) -> int:
        """How many pure-decode steps the run up to ``horizon_time`` takes: up to the
        first stop or memory running out, and the step that crosses the horizon.
        Nothing is changed but dropping stale stop entries; a fleet plans a run, and
        cuts it short (plans again) if a request is routed here before it ends."""
        d = self._n_dec
        steps = self.clock.steps
        kv = self._dec_kv_base + d * (steps - self._dec_mark)
        heap = self._stop_heap
        while heap and (not heap[0][3]._decoding or heap[0][3]._epoch != heap[0][2]):
            heapq.heappop(heap)  # drop stale entries so they do not shorten the jump
        k = heap[0][0] - steps if heap else 1 << 62
        # Device room, parked KV included: a run that would need a page-out stops
        # there, so the next call pages out exactly when the engine would.
        free = self.cfg.kv_capacity - (self._static_kv + kv + self._parked_kv)
        k = min(k, free // d)
        if horizon_time < math.inf:
            ride = self._ride_step_s(d, kv) if self._ride else 0.0
            horizon = horizon_time - self.now
            kt = self._steps_within(horizon, d, kv, ride)
            if self.cost.decode_span(kt, d, kv) + kt * ride < horizon:
                kt += 1  # the step that crosses the event ends at or after it
            k = min(k, max(kt, 1))
        if k <= 0:
            raise SimulationError("internal: decode run of zero steps")
        return k

    def _decode_span_s(self, k: int) -> float:
        """Seconds ``k`` pure-decode steps of the current batch take (what
        :meth:`_decode_apply` advances the clock by, pending eviction work aside)."""
        d = self._n_dec
        kv = self._dec_kv_base + d * (self.clock.steps - self._dec_mark)
        dt = self.cost.decode_span(k, d, kv)
        dt += k * self._ride_step_s(d, kv) if self._ride else 0.0
        if self._pending_swap:
            dt += self.cost.step_time(0, 0.0, 0, 0, self._pending_swap) - self.cost.step_time(
                0, 0.0, 0, 0
            )
        return dt

    def _decode_end(self, k: int, span: float | None = None) -> float:
        """The clock after :meth:`_decode_apply` of ``k`` steps (same arithmetic);
        ``span`` as there."""
        dt = self._decode_span_s(k) if span is None else span
        if self._pending_evict_s:
            dt += self._pending_evict_s
        return self.now + dt

    def _decode_apply(self, k: int, span: float | None = None) -> None:
        """Take ``k`` pure-decode steps at once (a run :meth:`_decode_plan` measured);
        ``span``: what :meth:`_decode_span_s` gave for them, where it was asked already
        and nothing has changed since."""
        d = self._n_dec
        dt = self._decode_span_s(k) if span is None else span
        self._pending_swap = 0
        self._advance(dt)
        self.clock.steps += k
        self.engine_steps += k
        self.tokens_generated += k * d
        self._track_peak()
        if self._chains:  # the blocks the run completed, before finishers leave
            self._offer_blocks([])
        heap = self._stop_heap
        if heap and heap[0][0] <= self.clock.steps:
            self._finish_due()

    def _ride_step_s(self, d: int, kv: int) -> float:
        """Seconds the decoders' riding rows add to each decode step (0 without any)."""
        if not self._ride:
            return 0.0
        cost = self.cost
        return cost.step_time(self._ride, 0.0, d, kv) - cost.step_time(0, 0.0, d, kv)

    def _steps_within(self, horizon: float, d: int, kv: int, ride: float) -> int:
        """Most decode steps of this batch, each ``ride`` s longer, that fit ``horizon``."""
        k = self.cost.decode_steps_within(horizon, d, kv)
        if not ride:
            return k
        lo, hi = 0, k  # (riding only lengthens the steps: at most k fit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.decode_span(mid, d, kv) + mid * ride <= horizon * (1 + 1e-12):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- main loop ---------------------------------------------------------------
    def run(
        self,
        jobs: Iterable[Job],
        progress: Callable[[int, int], None] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> SimResult:
        """Simulate until every job finished or was cancelled (or ``max_time``, or
        ``until()`` is true: it is asked whenever a request has ended)."""
        t0 = time.perf_counter()
        pending = sorted(jobs, key=lambda j: (j.request.arrival, j.request.rid))
        n_jobs = len(pending)
        if n_jobs and not pending[-1].request.arrival <= MAX_TIME_S:
            raise SimulationError(
                f"request {pending[-1].request.rid} arrives at t = "
                f"{pending[-1].request.arrival:.3g} s, past the {MAX_TIME_S:.0e} s a run can time"
            )
        i = 0
        wake: float = math.inf
        done_seen = 0
        ended = -1  # n_done when ``until`` was last asked
        idle_calls = 0
        max_time = self.cfg.max_time
        while True:
            while i < n_jobs and pending[i].request.arrival <= self.now:
                self.admit_arrival(pending[i])
                i += 1
            timers = self._timers
            while timers and timers[0] <= self.now:
                heapq.heappop(timers)
            if wake <= self.now:
                wake = math.inf
            next_event = min(
                pending[i].request.arrival if i < n_jobs else math.inf,
                timers[0] if timers else math.inf,
                wake,
            )
            if not self.running and not self.waiting and not self.suspended:
                if i >= n_jobs:
                    break
                self.now = max(self.now, pending[i].request.arrival)  # idle: nothing in system
                continue
            if self.now >= max_time:
                break
            if until is not None and self.n_done != ended and until():
                break
            ended = self.n_done

            snap = self.snapshot()
            dec = self.policy.schedule(snap)
            self.policy_calls += 1
            if dec.wake_at is not None and dec.wake_at > self.now:
                wake = min(wake, dec.wake_at)
                next_event = min(next_event, wake)
            chunks = self._apply(dec)
            self._check_limits(chunks, dec.prefill_only)

            if chunks or self._n_dec:
                idle_calls = 0
            if chunks:
                self._prefill_step(chunks, dec.prefill_only)
            elif self._n_dec:
                self._decode_run(min(next_event, max_time))
            elif self._pending_swap or self._pending_evict_s:
                self._prefill_step([])
            elif self.running or self.waiting or self.suspended:
                if not dec.is_empty():
                    # The decision changed state without running a step (a suspend,
                    # say): ask again at once, but not forever.
                    idle_calls += 1
                    if idle_calls > 10_000:
                        raise SimulationError(
                            f"policy {self.policy.name!r} changed state 10,000 times "
                            "without letting the engine run a step"
                        )
                    continue
                if next_event == math.inf:
                    raise SimulationError(
                        f"policy {self.policy.name!r} scheduled nothing with "
                        f"{len(self.waiting)} waiting and {len(self.suspended)} suspended "
                        "requests and no future event: the run would never end"
                    )
                self._advance(max(next_event - self.now, 0.0))
            if progress is not None and self.n_done - done_seen >= 1000:
                done_seen = self.n_done
                progress(done_seen, n_jobs)
        if progress is not None:
            progress(self.n_done, n_jobs)
        records = [self.records[j.request.rid] for j in pending if j.request.rid in self.records]
        return self.result(records, time.perf_counter() - t0)

    def result(self, records: list[RequestRecord], wall_s: float) -> SimResult:
        """The run so far as a :class:`SimResult` with ``records`` (the caller picks
        which, and their order): the run itself, and a fleet for each replica."""
        now = self.now
        return SimResult(
            records=records,
            sim_time=now,
            decode_steps=self.clock.steps,
            wall_s=wall_s,
            mean_in_system=self._area / now if now > 0 else 0.0,
            mean_running=self._area_run / now if now > 0 else 0.0,
            **self.run_counts(),
        )


def simulate(
    jobs: Iterable[Job],
    policy: Policy,
    cost: CostModel,
    config: SimConfig | None = None,
    predictor: JobPredictor | None = None,
) -> SimResult:
    """One-call convenience wrapper around :class:`Simulator`."""
    return Simulator(policy, cost, config, predictor).run(jobs)
