"""Deferred prefill: refill the batch only after K departures (Mohanty et al., EuroMLSys 2025).

The batch holds at most ``C`` requests (``max_num_seqs``, or ``capacity``).
The engine only decodes until ``K`` requests have left the batch (finished,
cancelled or preempted) since the last prefill phase (the paper's §2.3
rule); then one prefill phase refills every free slot it can from the
queue, in arrival order. A prefill phase stalls decoding, as in vLLM 0.6's
default scheduler that the paper measures: the prefill step runs alone
(``Decision.prefill_only``) and the running requests hold, keeping their
KV and slots, until it is done. ``K = 1`` is
vLLM's behaviour (prefill whenever a slot frees up).

Departures, not free slots: when KV memory stops a refill short of ``C``
with requests still waiting, the slots it leaves empty are not departures,
so the next phase waits for ``K`` more, as the paper's rule says (counting
free slots prefilled again after a single departure). When memory never
stops a refill the two counts are the same.

With prefill costing ``c_p + (t_p·d₀/N)·m`` for ``m`` prompts and a decode
step ``c_d + t_d·X``, fewer, larger prefills amortise ``c_p`` but leave
slots empty longer; the throughput ``ρ(K)`` and its maximiser ``K*`` are in
:mod:`duetime.analysis.deferred_prefill`. With the queue empty or the batch
empty the policy never waits.
"""

from __future__ import annotations

from typing import Any

from duetime.core.decision import Decision
from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register


@register("deferred-prefill")
class DeferredPrefill(QueuePolicy):
    """FCFS continuous batching that prefills only after ``k`` departures since the last phase.

    Departures are counted as ``self._left − n``: the batch size the last
    prefill phase left minus the batch size now (finished, cancelled and
    preempted requests are gone from ``snap.running``). That is one integer
    of state, the same in both executors (the policy sees only snapshots),
    and no per-request bookkeeping (so no ``forget``). Comparing the batch's
    set of rids between calls would cost O(C) a step and would have to net
    out a request that leaves for a segment gap and comes back without a
    prefill; the count does that by itself.

    How a phase ends sets the base. Memory (the next prompt does not fit,
    requests still waiting): ``_left`` is the batch it left, and the slots
    it left empty are not departures; only here do departures and free slots
    differ. A full batch: ``_left = C``. An empty queue: ``_left = C`` too, so
    slots left empty for want of requests count as departed and later
    arrivals get in once ``K`` slots are free (the paper's queue never
    empties; counting from a nearly empty batch would hold a lone arrival
    until the batch drains). The step's token budget: the phase goes on in
    the next step (``_refilling``), as vLLM runs a prefill phase longer than
    its token budget over consecutive prefill steps.
    """

    name = "deferred-prefill"

    def __init__(
        self,
        k: int = 1,
        *,
        capacity: int | None = None,
        stall_decode: bool = True,
        **kwargs: Any,
    ) -> None:
        if k < 1:
            raise ValueError(f"departure threshold k must be >= 1, got {k}")
        if capacity is not None and capacity < 1:
            raise ValueError(
                f"batch capacity must be >= 1 (or unset: max_num_seqs), got {capacity}"
            )
        kwargs.setdefault("chunked_prefill", False)
        super().__init__(**kwargs)
        self.k = k
        self.capacity = capacity
        self.stall_decode = stall_decode
        # Batch size the last prefill phase left, the base of the departure count; None
        # before the first phase, which counts as C (see the class docstring).
        self._left: int | None = None
        self._refilling = False  # the last phase ran out of step budget: go on with it

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = Decision(preempt_mode=self.preempt_mode)
        cap = min(self.capacity or snap.max_num_seqs, snap.max_num_seqs)
        n = len(snap.running)
        # Every decoder takes a token in the step after a prefill-only one, or in this one:
        # reserve a token each.
        free = snap.kv_free - snap.num_decoding
        back, free, n = self._segments_back(snap, dec, free, n, cap)

        # Without stalling, this step also decodes the batch and what resumes into it.
        budget = snap.max_batch_tokens
        if not self.stall_decode:
            budget -= snap.num_decoding + len(back)
        # A prompt longer than a step takes was admitted in pieces: it goes on first (its
        # memory was reserved when it was admitted, and is not in kv_free yet).
        admit: list[tuple[int, int]] = []
        for seq in snap.prefilling:
            free -= seq.prefill_remaining
            step = min(seq.prefill_remaining, budget)
            if step > 0:
                admit.append((seq.rid, step))
                budget -= step
        departed = (cap if self._left is None else self._left) - n
        if not snap.waiting:
            self._refilling = False  # nothing left to refill with: the phase is over
        elif self._refilling or n == 0 or departed >= min(self.k, cap):
            n_before = n
            n, stop = self._refill(snap, dec, admit, free, budget, n, cap)
            if n > n_before or self._refilling:  # a phase ran: count from what it leaves
                self._left = n if stop == "memory" else cap
            self._refilling = stop == "budget"
        if admit:
            dec.prefill = admit
            if self.stall_decode:  # the prefill step runs alone; the batch holds for it
                dec.prefill_only = True
                return dec  # ``back`` resumes after the prefill step
        dec.resume = back
        self._relieve(snap, dec)
        return dec

    def _refill(
        self,
        snap: EngineSnapshot,
        dec: Decision,
        admit: list[tuple[int, int]],
        free: int,
        budget: int,
        n: int,
        cap: int,
    ) -> tuple[int, str]:
        """Admit waiting prompts in order into ``admit``; the batch size and why it stopped.

        The reason is ``"full"`` (no slot), ``"memory"`` (the next prompt does not fit
        in KV memory), ``"budget"`` (nor in what is left of the step's tokens) or
        ``"empty"`` (the queue ran out).
        """
        for seq in snap.waiting:
            need = seq.prefill_target
            if need + 1 > snap.kv_capacity:
                # Grew (before a recompute preemption) past what memory can ever hold:
                # give up on it, as QueuePolicy does, or it blocks the queue for good.
                dec.cancel.append(seq.rid)
                continue
            # Whole prompts (less a prefix-cache hit), unless one is longer than any
            # step takes (may_chunk).
            step = self.first_chunk(seq, snap, need, budget)
            if n >= cap:
                return n, "full"
            if need + 1 > free:
                return n, "memory"
            if not 1 <= step <= budget:
                return n, "budget"
            admit.append((seq.rid, step))
            free -= need
            budget -= step
            n += 1
        return n, "empty"

    def _relieve(self, snap: EngineSnapshot, dec: Decision) -> None:
        """Memory pressure: give up the newest requests (vLLM) until the next step fits.

        The step adds a token per decoder, each prefill chunk, and for a resumed
        sequence a token plus its KV if it was paged out. A decoding batch keeps
        growing under a prompt prefilled in pieces, so this runs after mixed steps too.
        """
        chunks = dict(dec.prefill)
        resumed = set(dec.resume)

        def adds(s: Seq) -> int:
            if s.rid in chunks:
                return chunks[s.rid]
            if s.rid in resumed:
                return s.resume_tokens
            return 1 if s.prefill_done else 0

        pool = [*snap.running, *(s for s in snap.suspended if s.rid in resumed)]
        # Chunks of newly admitted prompts (not in the pool) count through ``chunks``.
        need = sum(chunks.values()) + sum(adds(s) for s in pool if s.rid not in chunks)
        have = snap.kv_free
        for v in sorted(pool, key=lambda s: s.order, reverse=True):
            if need <= have:
                break
            need -= adds(v)
            have += 0 if v.kv_offloaded else v.kv_tokens
            dec.prefill = [(rid, n) for rid, n in dec.prefill if rid != v.rid]
            if v.rid in resumed:
                dec.resume.remove(v.rid)
            dec.preempt.append(v.rid)

    def _segments_back(
        self, snap: EngineSnapshot, dec: Decision, free: int, n: int, cap: int
    ) -> tuple[list[int], int, int]:
        """Requests whose segment gap is over (TimelyLLM segments) rejoin the batch.

        They take a slot and memory before any admission: the paper has no
        segments, and a request half answered should not queue behind new ones.
        Returns the rids to resume and what is left of ``free`` and the slots.
        """
        back: list[int] = []
        for s in self.resumable(snap, dec):
            need = s.resume_tokens
            if n >= cap or need > free:
                break
            back.append(s.rid)
            free -= need
            n += 1
        return back, free, n
