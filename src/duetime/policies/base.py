"""The generic queue scheduler every simple policy is built from.

A policy here is three small choices (STYLE.md): the *order* of the waiting
queue (``waiting_key``), which running sequence to give up when memory runs
out (``victim_key``, largest first), and whether admission stops at the first
request that does not fit (head-of-line blocking, as vLLM's FCFS does). The
loop below turns them into a :class:`Decision`:

1. make room for the next decode step (one KV token per decoder), preempting
   victims; a sequence that cannot fit even alone is cancelled;
2. resume suspended sequences that are ready (segment gaps over, swapped out),
   oldest key first, while memory allows;
3. continue unfinished (chunked) prefills, then admit waiting sequences in
   queue order while memory, ``max_num_seqs`` and the step token budget allow.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Iterator
from operator import attrgetter
from typing import Any, Self, get_args

from duetime.core.decision import Decision, PreemptMode
from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot


class QueuePolicy:
    """Base class: FCFS order, newest-first victims, chunked prefill, HOL blocking."""

    name = "queue"
    default_predictor: str | None = None

    def __init__(
        self,
        *,
        chunked_prefill: bool = True,
        head_of_line_blocking: bool = True,
        preempt_mode: PreemptMode = "recompute",
        admit_headroom: int = 0,
    ) -> None:
        if preempt_mode not in get_args(PreemptMode):
            raise ValueError(
                f"preempt_mode must be one of {', '.join(get_args(PreemptMode))}, "
                f"got {preempt_mode!r}"
            )
        self.chunked_prefill = chunked_prefill
        self.head_of_line_blocking = head_of_line_blocking
        self.preempt_mode: PreemptMode = preempt_mode
        self.admit_headroom = admit_headroom

    def may_chunk(self, seq: Seq, snap: EngineSnapshot) -> bool:
        """Whether ``seq``'s prefill may run in pieces: always with chunked prefill,
        and without it when the prefill computes more tokens than a step's token
        budget (less any prefix-cache hit), since then no step could ever take it in
        one go (it would wait forever)."""
        if self.chunked_prefill:
            return True
        return seq.prefill_target - snap.prefix_hit(seq) > snap.max_batch_tokens

    def first_chunk(self, seq: Seq, snap: EngineSnapshot, need: int, budget: int) -> int:
        """Tokens the first prefill chunk of waiting ``seq`` (a prefill of ``need``
        tokens) runs in a step with ``budget`` tokens left: what it computes (less any
        prefix-cache hit, which is copied), cut to the budget where it may run in
        pieces (:meth:`may_chunk`), else all of it (over ``budget``: not this step).
        Memory is reserved for the whole ``need`` either way."""
        work = need - snap.prefix_hit(seq)
        return min(work, budget) if self.may_chunk(seq, snap) else work

    def fork(self) -> Self:
        """This policy with its private state as of now, to run on in another executor.

        A forecast (``sim/forecast.py``) plays the engine's image forward under
        the fork, so a policy that remembers (Amin's raised bounds, A_ℓ's promoted
        requests and queue tickets, TimeBill's evictions made, deferred prefill's
        departure count) decides there as it would here. The fork shares no
        mutable container with this instance; what they hold must be immutable
        and keyed by request id, never a :class:`Seq`: the executor restored from
        an image has sequences of its own. A policy keeping anything else
        overrides this.
        """
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, dict | set | list):
                setattr(new, name, value.copy())
        return new

    # --- the three choices --------------------------------------------------
    def forget(self, rid: int) -> None:
        """Drop any state kept for request ``rid`` (it is finished or cancelled).

        Both executors call this as each request ends, so per-request bookkeeping
        cannot grow without bound on a long-running server, and a policy sees the same
        calls in the simulator as on the engine.
        """

    def waiting_key(self, seq: Seq) -> Any:
        return seq.req.arrival

    def victim_key(self, seq: Seq, now: float) -> Any:
        """Larger = preempted first. Default: the most recently admitted (vLLM)."""
        return seq.order

    def admissible(self, seq: Seq, snap: EngineSnapshot) -> bool:
        """Extra admission rule (deadline checks, predicted-length checks). A request it
        refuses stays waiting and is asked about again at the next scheduling point;
        under head-of-line blocking the requests behind it wait too. To drop one for
        good (a deadline that has passed), cancel it in the decision instead: an
        executor with nothing running and every request refused here has nothing to
        wait for, and stops the run as a policy error."""
        return True

    # --- the generic loop ---------------------------------------------------
    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = Decision(preempt_mode=self.preempt_mode)
        free = snap.kv_free
        decoders = snap.num_decoding
        n_seqs = len(snap.running)

        if decoders > free:
            free, decoders, n_seqs = self._make_room(snap, dec, free, decoders, n_seqs)
        free -= decoders  # the next step writes one KV token per decoder

        free, decoders, n_seqs = self._resume_ready(snap, dec, free, decoders, n_seqs)

        budget = snap.max_batch_tokens - decoders
        for seq in snap.prefilling:
            if budget <= 0:
                break
            if seq.rid not in dec.preempt and seq.rid not in dec.cancel:
                n = min(seq.prefill_remaining, budget, free)
                if n <= 0:
                    continue
                if n < seq.prefill_remaining and not self.may_chunk(seq, snap):
                    continue
                dec.prefill.append((seq.rid, n))
                budget -= n
                free -= n

        for seq in snap.waiting:
            if n_seqs >= snap.max_num_seqs or budget <= 0:
                break
            need = seq.prefill_target
            if need + 1 > snap.kv_capacity:
                # Grew (before a recompute preemption) past what memory can ever hold.
                dec.cancel.append(seq.rid)
                continue
            # Admit only when the whole prompt fits (plus one token to decode),
            # so an admitted prefill never stalls for memory halfway. The step's
            # budget pays only for what it computes: a prefix-cache hit is copied.
            fits = need + 1 + self.admit_headroom <= free
            if fits and self.admissible(seq, snap):
                n = self.first_chunk(seq, snap, need, budget)
                if n > budget:
                    fits = False
                else:
                    dec.prefill.append((seq.rid, n))
                    budget -= n
                    free -= need
                    n_seqs += 1
                    continue
            if self.head_of_line_blocking:
                break
        if not (dec.prefill or dec.resume or decoders or dec.cancel or dec.preempt):
            self._break_deadlock(snap, dec)
        return dec

    def _break_deadlock(self, snap: EngineSnapshot, dec: Decision) -> Seq | None:
        """Nothing can run: idle KV holders (suspended, half-prefilled) fill the memory
        that the work in front of them needs. Release one so the next call can progress.

        Returns the sequence preempted, if any."""
        prefilling = list(snap.prefilling)
        parked = [s for s in snap.suspended if not s.kv_offloaded]
        ready = [s for s in parked if s.ready_at <= snap.now]
        blocked = bool(snap.waiting) or bool(prefilling) or bool(ready)
        holders = prefilling + parked
        if not holders or not blocked:
            return None
        now = snap.now
        if self.preempt_mode == "restart" and any(s.ready_at > now for s in parked):
            # A restart throws the holder's answer away and, first in the queue again, it
            # would redo it and park again: a livelock. Its gap ends by itself; wait.
            return None
        victim = max(holders, key=lambda s: self.victim_key(s, now))
        dec.preempt.append(victim.rid)
        return victim

    def _make_room(
        self, snap: EngineSnapshot, dec: Decision, free: int, decoders: int, n_seqs: int
    ) -> tuple[int, int, int]:
        now = snap.now
        candidates = list(snap.running)
        # The default victim key is the admission order: compare it in C.
        if type(self).victim_key is QueuePolicy.victim_key:
            key: Any = attrgetter("order")
        else:
            key = lambda s: self.victim_key(s, now)  # noqa: E731
        while decoders > free and candidates:
            # Usually one victim is enough: a max() per victim beats sorting the batch.
            v = max(candidates, key=key)
            candidates.remove(v)
            if n_seqs == 1 and v.kv_tokens + 1 > snap.kv_capacity:
                dec.cancel.append(v.rid)  # cannot fit even alone: give up, do not livelock
            else:
                dec.preempt.append(v.rid)
            free += v.kv_tokens
            decoders -= 1 if v.prefill_done else 0
            n_seqs -= 1
        return free, decoders, n_seqs

    def resume_candidates(self, snap: EngineSnapshot) -> list[Seq]:
        """Suspended sequences to resume, in the order to try them.

        Default: those whose segment gap is over, by the waiting key. A policy
        changes *which* and *in what order* here; the never-fits rule of
        :meth:`resumable` and the memory, ``max_num_seqs`` and step-token checks
        in :meth:`_resume_ready` apply to every policy that resumes through them.
        """
        ready = [s for s in snap.suspended if s.ready_at <= snap.now]
        ready.sort(key=lambda s: (self.waiting_key(s), s.order))
        return ready

    def resumable(
        self, snap: EngineSnapshot, dec: Decision, skip: Container[int] = ()
    ) -> Iterator[Seq]:
        """:meth:`resume_candidates` in order, less ``skip``; one that can never fit is cancelled.

        A sequence that cannot take another token even alone in memory would wait
        for good and hold the memory it has, so the resume loops (this class's,
        the Amin family's, deferred prefill's) draw their candidates from here and
        add only their own limits (slots, memory, step budget, future memory).
        """
        for s in self.resume_candidates(snap):
            if s.rid in skip:
                continue
            if s.kv_tokens + 1 > snap.kv_capacity:
                dec.cancel.append(s.rid)
                continue
            yield s

    def _resume_ready(
        self, snap: EngineSnapshot, dec: Decision, free: int, decoders: int, n_seqs: int
    ) -> tuple[int, int, int]:
        if not snap.suspended:
            return free, decoders, n_seqs
        for s in self.resumable(snap, dec):
            need = s.resume_tokens
            # A resumed sequence decodes in this very step, so it takes a token of the
            # step's budget too: more decoders than max_batch_tokens is an illegal step.
            if n_seqs >= snap.max_num_seqs or need > free or decoders >= snap.max_batch_tokens:
                break
            dec.resume.append(s.rid)
            free -= need
            decoders += 1
            n_seqs += 1
        return free, decoders, n_seqs
