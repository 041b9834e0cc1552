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
from duetime.core.decision import Decision
from duetime.core.policy import Policy, PolicyError
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import DecodeClock, Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.core.waiting import WaitingQueue
from duetime.predict.oracle import JobPredictor


class SimulationError(RuntimeError):
    """The simulation cannot make progress (a policy that never schedules, say)."""


@dataclass(slots=True)
class SimConfig:
    """Engine limits the simulator enforces. KV capacity is in tokens."""

    kv_capacity: int = 110_000
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    max_time: float = math.inf  # stop the clock here (unfinished requests stay unfinished)


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


class Simulator:
    """Plays a list of jobs through a policy on a modelled engine."""

    def __init__(
        self,
        policy: Policy,
        cost: CostModel,
        config: SimConfig | None = None,
        predictor: JobPredictor | None = None,
    ) -> None:
        self.policy = policy
        self.cost = cost
        self.cfg = config or SimConfig()
        self.predictor = predictor
        self.clock = DecodeClock()
        self.now = 0.0
        self.waiting = WaitingQueue(policy.waiting_key)
        self.running: dict[int, Seq] = {}
        self.prefilling: dict[int, Seq] = {}  # running with prefill unfinished
        self.suspended: dict[int, Seq] = {}
        self.seqs: dict[int, Seq] = {}
        self.records: dict[int, RequestRecord] = {}
        self._jobs: dict[int, Job] = {}
        self._stop_heap: list[tuple[int, int, int, Seq]] = []  # (stop_step, order, epoch, seq)
        self._timers: list[float] = []  # ready_at of suspended sequences and policy wake-ups
        # Running sums, re-based whenever the decoding set changes.
        self._n_dec = 0  # decoding sequences
        self._dec_kv_base = 0  # Σ kv of decoders at step _dec_mark
        self._dec_mark = 0
        self._static_kv = 0  # device KV of non-decoding holders (prefilling, suspended)
        self._order = 0
        self._pending_swap = 0
        self.kv_peak = 0
        self.engine_steps = 0
        self.policy_calls = 0
        self.preemptions = 0
        self.counters: dict[str, int] = {"rejected": 0, "cancelled": 0, "swaps": 0}
        self.n_done = 0  # finished + cancelled
        self.tokens_generated = 0  # every output token the modelled engine produced
        self._area = 0.0  # ∫ (requests in system) dt, measured independently of the records
        self._area_run = 0.0  # ∫ (running sequences) dt

    # --- running sums -------------------------------------------------------
    def _dec_kv(self) -> int:
        return self._dec_kv_base + self._n_dec * (self.clock.steps - self._dec_mark)

    def _rebase(self) -> None:
        self._dec_kv_base = self._dec_kv()
        self._dec_mark = self.clock.steps

    @property
    def kv_used(self) -> int:
        return self._static_kv + self._dec_kv()

    def _start_decoding(self, seq: Seq) -> None:
        self._rebase()
        seq._start_decoding()
        self._n_dec += 1
        self._dec_kv_base += seq.kv_tokens
        stop = self._stop_point(seq)
        heapq.heappush(
            self._stop_heap, (self.clock.steps + stop - seq.generated, seq.order, seq._epoch, seq)
        )

    def _stop_decoding(self, seq: Seq) -> None:
        self._rebase()
        self._dec_kv_base -= seq.kv_tokens
        self._n_dec -= 1
        seq._stop_decoding()

    def _stop_point(self, seq: Seq) -> int:
        """Generated-token count at which the sequence next stops (segment end or done)."""
        return seq.segment_end

    # --- arrivals ---------------------------------------------------------------
    def _admit_arrival(self, job: Job) -> None:
        req = job.request
        if req.rid in self.seqs:
            raise SimulationError(f"duplicate request id {req.rid}")
        if self.predictor is not None and req.predicted is None:
            req.predicted = self.predictor.predict_job(job)
        seq = Seq(req, self.clock, self._order)
        self._order += 1
        target = min(job.output_len, req.max_tokens)
        self._jobs[req.rid] = job
        seq.segment_end = min(job.segments[0], target) if job.segments else target
        self.seqs[req.rid] = seq
        rec = RequestRecord(request=req, target_tokens=target)
        self.records[req.rid] = rec
        if req.prompt_len + 1 > self.cfg.kv_capacity:
            # Can never fit: refuse at once, as vLLM rejects prompts over max_model_len.
            seq.status = SeqStatus.CANCELLED
            rec.cancelled_at = self.now
            self.counters["rejected"] += 1
            self.n_done += 1
            return
        self.waiting.push(seq)

    # --- applying a decision -------------------------------------------------------
    def _get(self, rid: int, what: str) -> Seq:
        seq = self.seqs.get(rid)
        if seq is None:
            raise PolicyError(f"policy {self.policy.name!r}: {what} of unknown request {rid}")
        return seq

    def _release(self, seq: Seq) -> None:
        """Take a sequence out of running/suspended and free its device KV."""
        if seq.status is SeqStatus.RUNNING:
            if seq.decoding:
                self._stop_decoding(seq)
            else:
                self._static_kv -= seq.kv_tokens
                del self.prefilling[seq.rid]
            del self.running[seq.rid]
        elif seq.status is SeqStatus.SUSPENDED:
            if not seq.kv_offloaded:
                self._static_kv -= seq.kv_tokens
            del self.suspended[seq.rid]
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)

    def _apply(self, dec: Decision) -> list[tuple[Seq, int]]:
        name = self.policy.name
        for rid in dec.cancel:
            seq = self._get(rid, "cancel")
            if seq.status >= SeqStatus.FINISHED:
                raise PolicyError(f"policy {name!r}: cancel of {seq.status.name} request {rid}")
            self._release(seq)
            seq.status = SeqStatus.CANCELLED
            self.records[rid].cancelled_at = self.now
            self.records[rid].output_tokens = seq.generated
            self.counters["cancelled"] += 1
            self.n_done += 1
        for rid in dec.preempt:
            seq = self._get(rid, "preempt")
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.SUSPENDED):
                raise PolicyError(f"policy {name!r}: preempt of {seq.status.name} request {rid}")
            kv = seq.kv_tokens
            self._release(seq)
            self.preemptions += 1
            seq.num_preemptions += 1
            if dec.preempt_mode == "swap" and seq.prefill_done:
                seq.status = SeqStatus.SUSPENDED
                seq.kv_offloaded = True
                self.suspended[rid] = seq
                self._pending_swap += kv
                self.counters["swaps"] += 1
            else:  # recompute: recompute prompt + generated tokens later
                seq.status = SeqStatus.WAITING
                seq.prefill_target = seq.req.prompt_len + seq.generated
                seq.prefilled = 0
                seq.kv_evicted = 0
                seq.kv_offloaded = False
                self.waiting.push(seq)
        for rid in dec.suspend:
            seq = self._get(rid, "suspend")
            if seq.status is not SeqStatus.RUNNING or not seq.prefill_done:
                raise PolicyError(f"policy {name!r}: suspend of non-decoding request {rid}")
            self._stop_decoding(seq)
            del self.running[rid]
            self._static_kv += seq.kv_tokens
            seq.status = SeqStatus.SUSPENDED
            self.suspended[rid] = seq
        for rid in dec.resume:
            seq = self._get(rid, "resume")
            if seq.status is not SeqStatus.SUSPENDED:
                raise PolicyError(f"policy {name!r}: resume of {seq.status.name} request {rid}")
            del self.suspended[rid]
            if seq.kv_offloaded:
                seq.kv_offloaded = False
                self._pending_swap += seq.kv_tokens
            else:
                self._static_kv -= seq.kv_tokens
            seq.status = SeqStatus.RUNNING
            self.running[rid] = seq
            self._start_decoding(seq)
        for rid, alpha in dec.evict.items():
            seq = self._get(rid, "evict")
            if not (0.0 <= alpha < 1.0):
                raise PolicyError(f"policy {name!r}: eviction ratio {alpha} not in [0, 1)")
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.SUSPENDED) or not seq.prefill_done:
                raise PolicyError(f"policy {name!r}: evict on request {rid} without a full KV")
            n = int(alpha * seq.kv_tokens)
            seq.kv_evicted += n
            if seq.decoding:
                self._rebase()
                self._dec_kv_base -= n
            elif not seq.kv_offloaded:
                self._static_kv -= n
            self.records[rid].kv_evicted_ratio = alpha
        chunks: list[tuple[Seq, int]] = []
        for rid, n in dec.prefill:
            seq = self._get(rid, "prefill")
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running[rid] = seq
                self.prefilling[rid] = seq
            elif seq.status is not SeqStatus.RUNNING or seq.prefill_done:
                raise PolicyError(f"policy {name!r}: prefill of request {rid} in {seq!r}")
            n = seq.prefill_remaining if n <= 0 else min(n, seq.prefill_remaining)
            chunks.append((seq, n))
        return chunks

    def _check_limits(self, chunks: list[tuple[Seq, int]]) -> None:
        name = self.policy.name
        p_tokens = sum(n for _, n in chunks)
        if p_tokens + self._n_dec > self.cfg.max_batch_tokens:
            raise PolicyError(
                f"policy {name!r}: step has {p_tokens} prefill + {self._n_dec} decode tokens, "
                f"over max_batch_tokens={self.cfg.max_batch_tokens}"
            )
        if len(self.running) > self.cfg.max_num_seqs:
            raise PolicyError(
                f"policy {name!r}: {len(self.running)} running sequences, "
                f"over max_num_seqs={self.cfg.max_num_seqs}"
            )
        need = self.kv_used + p_tokens + self._n_dec
        if need > self.cfg.kv_capacity:
            raise PolicyError(
                f"policy {name!r}: next step needs {need} KV tokens, "
                f"capacity is {self.cfg.kv_capacity} (at t={self.now:.3f}s)"
            )

    # --- steps ------------------------------------------------------------------
    def _finish_due(self) -> bool:
        """Handle every decoder whose stop point has been reached. True if any."""
        heap = self._stop_heap
        steps = self.clock.steps
        any_done = False
        while heap and heap[0][0] <= steps:
            _, _, epoch, seq = heapq.heappop(heap)
            if not seq.decoding or seq._epoch != epoch:
                continue  # stale: preempted, suspended or re-started since
            any_done = True
            self._reach_stop(seq)
        return any_done

    def _reach_stop(self, seq: Seq) -> None:
        rec = self.records[seq.rid]
        job = self._jobs[seq.rid]
        target = rec.target_tokens
        self._stop_decoding(seq)
        del self.running[seq.rid]
        rec.segment_done.append(self.now)
        if seq.generated >= target:
            seq.status = SeqStatus.FINISHED
            self.n_done += 1
            rec.finish = self.now
            rec.output_tokens = seq.generated
            rec.num_preemptions = seq.num_preemptions
            return
        # Segment boundary: keep KV, wait for the client to want the next segment.
        k = seq.segment_index
        gap = job.segment_gaps[k] if k < len(job.segment_gaps) else 0.0
        seq.segment_index = k + 1
        nxt = job.segments[k + 1] if k + 1 < len(job.segments) else target
        seq.segment_end = min(seq.segment_end + nxt, target)
        seq.ready_at = self.now + gap
        rec.segment_ready.append(seq.ready_at)
        seq.status = SeqStatus.SUSPENDED
        self._static_kv += seq.kv_tokens
        self.suspended[seq.rid] = seq
        heapq.heappush(self._timers, seq.ready_at)

    def _prefill_step(self, chunks: list[tuple[Seq, int]]) -> None:
        """One step with prefill chunks (and every decoder taking one token)."""
        p_tokens = 0
        attn = 0.0
        for seq, n in chunks:
            p_tokens += n
            attn += n * (seq.prefilled + n)
        swap = self._pending_swap
        self._pending_swap = 0
        dt = self.cost.step_time(p_tokens, attn, self._n_dec, self._dec_kv(), swap)
        self._advance(dt)
        self.engine_steps += 1
        if self._n_dec:
            self.clock.steps += 1
            self.tokens_generated += self._n_dec
        self._static_kv += p_tokens
        self._track_peak()
        for seq, n in chunks:
            seq.prefilled += n
            if seq.prefilled < seq.prefill_target:
                continue
            # Prefill done: it produced one token; KV holds prefill_target tokens.
            del self.prefilling[seq.rid]
            self.tokens_generated += 1
            self._static_kv -= seq.prefilled
            rec = self.records[seq.rid]
            if seq.first_token_time is None:
                seq.first_token_time = self.now
                rec.first_token = self.now
            seq._set_generated(seq.prefill_target - seq.req.prompt_len + 1)
            # Join the decoders; one whose stop is already reached (a one-token
            # answer, a segment of one) is popped by _finish_due right below.
            self._start_decoding(seq)
        self._finish_due()

    def _decode_run(self, horizon_time: float) -> None:
        """Advance pure-decode steps up to the next event."""
        d = self._n_dec
        kv = self._dec_kv()
        heap = self._stop_heap
        while heap and (not heap[0][3].decoding or heap[0][3]._epoch != heap[0][2]):
            heapq.heappop(heap)  # drop stale entries so they do not shorten the jump
        k = self._stop_heap[0][0] - self.clock.steps if self._stop_heap else 1 << 62
        free = self.cfg.kv_capacity - self.kv_used
        k = min(k, free // d)
        if horizon_time < math.inf:
            horizon = horizon_time - self.now
            kt = self.cost.decode_steps_within(horizon, d, kv)
            if self.cost.decode_span(kt, d, kv) < horizon:
                kt += 1  # the step that crosses the event ends at or after it
            k = min(k, max(kt, 1))
        if k <= 0:
            raise SimulationError("internal: decode run of zero steps")
        swap = self._pending_swap
        self._pending_swap = 0
        dt = self.cost.decode_span(k, d, kv)
        if swap:
            dt += self.cost.step_time(0, 0.0, 0, 0, swap) - self.cost.step_time(0, 0.0, 0, 0)
        self._advance(dt)
        self.clock.steps += k
        self.engine_steps += k
        self.tokens_generated += k * d
        self._track_peak()
        self._finish_due()

    def _advance(self, dt: float) -> None:
        n_run = len(self.running)
        self._area += (n_run + len(self.waiting) + len(self.suspended)) * dt
        self._area_run += n_run * dt
        self.now += dt

    def _track_peak(self) -> None:
        used = self.kv_used
        if used > self.kv_peak:
            self.kv_peak = used

    # --- main loop ---------------------------------------------------------------
    def run(
        self, jobs: Iterable[Job], progress: Callable[[int, int], None] | None = None
    ) -> SimResult:
        """Simulate until every job finished or was cancelled (or ``max_time``)."""
        t0 = time.perf_counter()
        pending = sorted(jobs, key=lambda j: (j.request.arrival, j.request.rid))
        n_jobs = len(pending)
        i = 0
        wake: float = math.inf
        done_seen = 0
        idle_calls = 0
        max_time = self.cfg.max_time
        while True:
            while i < n_jobs and pending[i].request.arrival <= self.now:
                self._admit_arrival(pending[i])
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

            snap = EngineSnapshot(
                now=self.now,
                waiting=self.waiting,  # type: ignore[arg-type]
                running=self.running.values(),  # type: ignore[arg-type]
                prefilling=self.prefilling.values(),  # type: ignore[arg-type]
                suspended=self.suspended.values(),  # type: ignore[arg-type]
                kv_capacity=self.cfg.kv_capacity,
                kv_free=self.cfg.kv_capacity - self.kv_used,
                max_num_seqs=self.cfg.max_num_seqs,
                max_batch_tokens=self.cfg.max_batch_tokens,
                num_decoding=self._n_dec,
                cost=self.cost if isinstance(self.cost, LinearStepCost) else None,
            )
            dec = self.policy.schedule(snap)
            self.policy_calls += 1
            if dec.wake_at is not None and dec.wake_at > self.now:
                wake = min(wake, dec.wake_at)
                next_event = min(next_event, wake)
            chunks = self._apply(dec)
            self._check_limits(chunks)

            if chunks or self._n_dec:
                idle_calls = 0
            if chunks:
                self._prefill_step(chunks)
            elif self._n_dec:
                self._decode_run(min(next_event, max_time))
            elif self._pending_swap:
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
        return SimResult(
            records=[self.records[j.request.rid] for j in pending if j.request.rid in self.records],
            sim_time=self.now,
            engine_steps=self.engine_steps,
            decode_steps=self.clock.steps,
            policy_calls=self.policy_calls,
            preemptions=self.preemptions,
            wall_s=time.perf_counter() - t0,
            kv_peak=self.kv_peak,
            tokens_generated=self.tokens_generated,
            mean_in_system=self._area / self.now if self.now > 0 else 0.0,
            mean_running=self._area_run / self.now if self.now > 0 else 0.0,
            counters=dict(self.counters),
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
