"""TimelyLLM (Ling, Chen, Zhong): PUD priority over initial and suspended generations.

Source: ``../shared/seeds/timelyllm.txt``, §4.3 Eq. 4 and §4.4. At every
scheduling point the priority of each candidate segment ``s_k`` of request
``i`` is recomputed at ``t = snap.now``::

    Pri(s_k, t) = (δ_k·TUF0(W(s_k; t)) + (1 − δ_k)·TUF1(W(s_k; t))) / (G(s_k)·L(s_k))
    δ_k = 1 if k = 0 else 0

- ``G``: expected generation time of the segment. The paper profiles it
  (90 ms for its robot segments). We estimate it from the executor's cost
  model: ``segment_tokens`` decode steps at the batch size the segment would
  join, plus the remaining prefill for a first segment; ``segment_tokens``
  defaults to 10, the paper's "maximum token length" of a robot segment.
  Without a cost model ``G = g_default`` (90 ms), and a new request's prefill
  is priced as one more ``g_default`` (180 ms in all).
- ``W(s_k; t)``: the waiting time of the segment if its generation begins at
  ``t``: ``t + G − arrival`` for ``k = 0``; ``t + G − ready_at`` for ``k > 0``,
  where ``ready_at`` is when the executor expects the robot to finish the
  previous segment's action: ``max(previous segment delivered, previous
  ready_at) + estimated action time`` (the time model's; a search's minimum,
  ``Job.segment_gap_estimates``). TUF1 has ERT = 0 and
  clips negative waits (``TimeUtility.later_segment``).
- ``L``: slack, the time left until the segment is due after generating it:
  ``max(due − t − G, l_min)`` with ``due = arrival + ERT`` (k = 0) or
  ``ready_at`` (k > 0). ``l_min`` (10 ms, about one decode step) keeps the
  ratio finite for segments already due.

A suspended segment becomes a candidate ``lead × G`` (default 2 G, since G is
an estimate) before its ``ready_at`` (the
paper generates the next segment *before* the robot completes the previous
action); the policy asks to be woken then. Candidates are admitted (waiting)
or resumed (suspended) in priority order while KV memory, ``max_num_seqs`` and
the step token budget allow; a candidate that does not fit is skipped, not
waited for. Running generations are never preempted: segment boundaries free
the batch often enough (§4.1).

Latency-guided batch size (§4.4): before adding a generation, the most
urgent running one (least time left to its segment's due time) must still
finish its segment in time with one more sequence in the batch. Its WCET is
this step (every prefill chunk admitted so far in this call, the candidate's
included, beside the decoders) plus ``remaining − 1`` decode steps of the
batch those admissions make, remaining = ``segment_tokens`` − tokens generated
since it was (re)started (at least 1), step times from the cost model (on the
simulator that *is* the recent speed; on the engine it is the fitted profile).
If it would meet its due time with what this call has added so far but not
with the candidate too, nothing more is added this step. The memory check is
the admission rule above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from duetime.core.cost import chunk_attention
from duetime.core.decision import Decision
from duetime.core.request import TimeUtility
from duetime.core.sequence import Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register

_NO_TUF = TimeUtility(ert=math.inf)  # requests without a TUF: never late, utility β = 1


def pud_priority(
    tuf: TimeUtility, k: int, now: float, g: float, arrival: float, ready_at: float, l_min: float
) -> float:
    """Eq. 4 for segment ``k`` starting generation at ``now`` (see the module docstring)."""
    if k == 0:
        util = tuf(now + g - arrival)
        due = arrival + tuf.ert
    else:
        util = tuf.later_segment()(now + g - ready_at)
        due = ready_at
    slack = max(due - now - g, l_min)
    return util / (g * slack)


@dataclass(frozen=True)
class _StepWork:
    """The next step as admitted so far: its prefill chunks and the batch around it."""

    prefill_tokens: int
    prefill_attn: float  # the chunks' A, as the cost model prices it (chunk_attention)
    decoders_now: int  # sequences that decode in this step
    decoders_after: int  # ... and in the steps after it (this step's prefills joined)
    attend: Callable[[float, float], float]  # a chunk's A: the snapshot's cost model's

    @staticmethod
    def of(chunks: list[tuple[int, int]], snap: EngineSnapshot, decoders: int) -> _StepWork:
        by_rid = {s.rid: s for s in snap.prefilling}
        attend = chunk_attention if snap.cost is None else snap.cost.chunk_attention
        tokens = sum(n for _, n in chunks)
        attn = sum(attend(n, by_rid[rid].prefilled + n) for rid, n in chunks)
        return _StepWork(tokens, attn, decoders, decoders + len(chunks), attend)

    def plus(self, seq: Seq, budget: int, hit: int = 0) -> _StepWork:
        """This step with ``seq`` resumed (it decodes now) or prefilled (it decodes after;
        ``hit`` of its prompt tokens found in the prefix cache, so not computed)."""
        if seq.status is SeqStatus.SUSPENDED:
            return replace(
                self, decoders_now=self.decoders_now + 1, decoders_after=self.decoders_after + 1
            )
        n = max(min(seq.prefill_target - hit, budget), 0)
        return replace(
            self,
            prefill_tokens=self.prefill_tokens + n,
            prefill_attn=self.prefill_attn + self.attend(n, seq.prefilled + hit + n),
            decoders_after=self.decoders_after + 1,
        )


@register("timelyllm")
class TimelyLLM(QueuePolicy):
    """PUD priority (Eq. 4) over waiting and suspended segments, latency-guided batching."""

    name = "timelyllm"

    def __init__(
        self,
        *,
        segment_tokens: int = 10,
        g_default: float = 0.09,
        l_min: float = 0.01,
        latency_guard: bool = True,
        lead: float = 2.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("head_of_line_blocking", False)
        kwargs.pop("seed", None)
        super().__init__(**kwargs)
        self.segment_tokens = segment_tokens
        self.g_default = g_default
        self.l_min = l_min
        self.latency_guard = latency_guard
        self.lead = lead
        self._seg_start: dict[int, int] = {}  # rid -> generated count when (re)started

    def forget(self, rid: int) -> None:
        self._seg_start.pop(rid, None)

    def waiting_key(self, seq: Seq) -> Any:
        return (seq.req.arrival, seq.order)  # storage order only; priority is in schedule

    # --- estimates ------------------------------------------------------------
    def _step(self, snap: EngineSnapshot, d: int) -> float:
        cost = snap.cost
        if cost is None:
            return self.g_default / self.segment_tokens
        kv = snap.kv_capacity - snap.kv_free
        return cost.step_time(0, 0.0, d, kv)

    @staticmethod
    def _due(seq: Seq) -> float:
        tuf = seq.req.tuf or _NO_TUF
        return seq.req.arrival + tuf.ert if seq.segment_index == 0 else seq.ready_at

    # --- the loop ---------------------------------------------------------------
    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = Decision(preempt_mode=self.preempt_mode)
        now = snap.now
        free = snap.kv_free
        decoders = snap.num_decoding
        n_seqs = len(snap.running)
        if decoders > free:
            free, decoders, n_seqs = self._make_room(snap, dec, free, decoders, n_seqs)
        free -= decoders

        budget = snap.max_batch_tokens - decoders
        for seq in snap.prefilling:  # finish chunked prefills first
            if budget <= 0:
                break
            if seq.rid in dec.preempt or seq.rid in dec.cancel:
                continue
            n = min(seq.prefill_remaining, budget, free)
            if n > 0:
                dec.prefill.append((seq.rid, n))
                budget -= n
                free -= n

        step = self._step(snap, decoders + 1)
        g_dec = self.segment_tokens * step
        cost = snap.cost
        wake = math.inf
        cands: list[tuple[float, int, Seq]] = []
        for s in snap.suspended:
            lead = self.lead * g_dec
            if s.ready_at - lead > now:
                wake = min(wake, s.ready_at - lead)
                continue
            tuf = s.req.tuf or _NO_TUF
            pri = pud_priority(
                tuf, s.segment_index, now, g_dec, s.req.arrival, s.ready_at, self.l_min
            )
            cands.append((-pri, s.order, s))
        for s in snap.waiting:
            g = g_dec
            if cost is not None:
                g += cost.prefill_time(s.prefill_target)
            else:
                g += self.g_default
            tuf = s.req.tuf or _NO_TUF
            k = s.segment_index
            pri = pud_priority(tuf, k, now, g, s.req.arrival, s.ready_at, self.l_min)
            cands.append((-pri, s.order, s))
        cands.sort(key=lambda c: (c[0], c[1]))

        guard = self._guard(snap, decoders) if self.latency_guard else None
        # What this step already carries beside its decoders (the chunks above) and the
        # sequences that join the batch after it: the guard weighs each candidate on top.
        step_work = _StepWork.of(dec.prefill, snap, decoders)
        for _, _, s in cands:
            if n_seqs >= snap.max_num_seqs:
                break
            guarded = guard is not None and decoders > 0
            # The step if ``s`` goes in. A waiting one's prefix hit is looked up only
            # when the guard weighs it or it fits: a lookup for every queued request
            # in every step would cost more than the step under a long queue.
            hit = 0
            if s.status is SeqStatus.WAITING and (
                guarded or (s.prefill_target + 1 <= free and budget > 0)
            ):
                hit = snap.prefix_hit(s)
            with_s = step_work.plus(s, budget, hit)
            if guard is not None and decoders > 0:
                due_left, remaining = guard
                if (
                    self._wcet(snap, step_work, remaining)
                    <= due_left
                    < self._wcet(snap, with_s, remaining)
                ):
                    break  # one more sequence would make the most urgent generation late
            if s.status is SeqStatus.SUSPENDED:
                need = s.resume_tokens
                if s.kv_tokens + 1 > snap.kv_capacity:
                    dec.cancel.append(s.rid)
                    continue
                if need > free or budget <= 0:
                    continue
                step_work = with_s
                dec.resume.append(s.rid)
                self._seg_start[s.rid] = s.generated
                free -= need
                budget -= 1  # it decodes in this very step
                decoders += 1
                n_seqs += 1
            else:
                need = s.prefill_target
                if need + 1 > snap.kv_capacity:
                    dec.cancel.append(s.rid)
                    continue
                if need + 1 > free or budget <= 0:
                    continue
                n = min(need - hit, budget)
                step_work = with_s
                dec.prefill.append((s.rid, n))
                self._seg_start[s.rid] = s.generated
                budget -= n
                free -= need
                n_seqs += 1
        if wake < math.inf:
            dec.wake_at = wake
        if not (dec.prefill or dec.resume or decoders or dec.cancel or dec.preempt):
            self._break_deadlock(snap, dec)
        return dec

    def _wcet(self, snap: EngineSnapshot, work: _StepWork, remaining: int) -> float:
        """Time for the most urgent generation's ``remaining`` tokens under ``work``."""
        cost = snap.cost
        if cost is None:
            return remaining * self._step(snap, work.decoders_after)
        kv = snap.kv_capacity - snap.kv_free
        first = cost.step_time(work.prefill_tokens, work.prefill_attn, work.decoders_now, kv)
        return first + (remaining - 1) * cost.step_time(0, 0.0, work.decoders_after, kv)

    def _guard(self, snap: EngineSnapshot, decoders: int) -> tuple[float, int] | None:
        """(time left to its due time, tokens left) of the most urgent decoding generation."""
        best: tuple[float, int] | None = None
        for s in snap.running:
            if not s.prefill_done:
                continue
            left = self._due(s) - snap.now
            if left <= 0:
                continue  # already late: adding work cannot save it
            done = s.generated - self._seg_start.get(s.rid, 0)
            remaining = max(self.segment_tokens - done, 1)
            if best is None or left < best[0]:
                best = (left, remaining)
        return best


@register("vllm-stream")
class VLLMStream(QueuePolicy):
    """vLLM FCFS that streams: generation never stops at a segment boundary.

    The executor suspends a sequence at each segment end (that is how it
    records when each executable action was produced); this policy resumes
    every such sequence in the same call, before any admission, so it keeps its
    KV and batch slot and the schedule is that of unsegmented FCFS. What the
    robot does with the streamed segments (start each action when it has both
    the segment and finished the previous action) is scored by the caller, see
    ``duetime.bench.timelyllm.robot_outcome``.
    """

    name = "vllm-stream"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("seed", None)
        super().__init__(**kwargs)

    def resume_candidates(self, snap: EngineSnapshot) -> list[Seq]:
        """Every suspended sequence, ready or not, in admission order."""
        return sorted(snap.suspended, key=lambda s: s.order)
