"""Deferred prefill: refill the batch only after K departures (Mohanty et al., EuroMLSys 2025).

The batch holds at most ``C`` requests (``max_num_seqs``, or ``capacity``).
While fewer than ``K`` of its slots are free the engine only decodes; once
``K`` or more are free (``K`` departures since the batch was last full) it
runs one prefill phase that refills every free slot from the queue, in
arrival order. A prefill phase stalls decoding, as in vLLM 0.6's default
scheduler that the paper measures: the running requests are suspended for
the prefill step and resumed right after it. ``K = 1`` is vLLM's behaviour
(prefill whenever a slot frees up).

With prefill costing ``c_p + (t_p·d₀/N)·m`` for ``m`` prompts and a decode
step ``c_d + t_d·X``, fewer, larger prefills amortise ``c_p`` but leave
slots empty longer; the throughput ``ρ(K)`` and its maximiser ``K*`` are in
:mod:`duetime.analysis.deferred_prefill`. With the queue empty or the batch
empty the policy never waits.
"""

from __future__ import annotations

from typing import Any

from duetime.core.decision import Decision
from duetime.core.sequence import Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register


@register("deferred-prefill")
class DeferredPrefill(QueuePolicy):
    """FCFS continuous batching that prefills only once ``k`` batch slots are free."""

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
        kwargs.setdefault("chunked_prefill", False)
        super().__init__(**kwargs)
        self.k = k
        self.capacity = capacity
        self.stall_decode = stall_decode
        self._stalled: list[Seq] = []  # suspended by us for the prefill step just run

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = Decision(preempt_mode=self.preempt_mode)
        cap = min(self.capacity or snap.max_num_seqs, snap.max_num_seqs)
        stalled = [s for s in self._stalled if s.status is SeqStatus.SUSPENDED]
        self._stalled = []
        n = len(snap.running) + len(stalled)
        # Every held request decodes in the step after this one: reserve a token each, and
        # the KV of a stalled one that was paged out meanwhile (offload_suspended).
        free = snap.kv_free - snap.num_decoding
        free -= sum(s.resume_tokens for s in stalled)
        back, free, n = self._segments_back(snap, dec, stalled, free, n, cap)

        # Without stalling, this step also decodes the batch and what resumes into it.
        budget = snap.max_batch_tokens
        if not self.stall_decode:
            budget -= snap.num_decoding + len(stalled) + len(back)
        # A prompt longer than a step takes was admitted in pieces: it goes on first (its
        # memory was reserved when it was admitted, and is not in kv_free yet).
        admit: list[tuple[int, int]] = []
        for seq in snap.prefilling:
            free -= seq.prefill_remaining
            step = min(seq.prefill_remaining, budget)
            if step > 0:
                admit.append((seq.rid, step))
                budget -= step
        if snap.waiting and (cap - n >= min(self.k, cap) or n == 0):
            for seq in snap.waiting:
                need = seq.prefill_target
                if need + 1 > snap.kv_capacity:
                    # Grew (before a recompute preemption) past what memory can ever hold:
                    # give up on it, as QueuePolicy does, or it blocks the queue for good.
                    dec.cancel.append(seq.rid)
                    continue
                # Whole prompts, unless one is longer than any step takes (may_chunk).
                step = min(need, budget) if self.may_chunk(seq, snap) else need
                if n >= cap or need + 1 > free or not 1 <= step <= budget:
                    break
                admit.append((seq.rid, step))
                free -= need
                budget -= step
                n += 1
        if admit:
            dec.prefill = admit
            if self.stall_decode:  # the prefill step runs alone; the batch waits for it
                dec.suspend = [s.rid for s in snap.running if s.prefill_done]
                self._stalled = stalled + [s for s in snap.running if s.prefill_done]
                return dec  # ``back`` resumes after the prefill step
        dec.resume = [s.rid for s in stalled] + back
        self._relieve(snap, dec)
        return dec

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
        self, snap: EngineSnapshot, dec: Decision, stalled: list[Seq], free: int, n: int, cap: int
    ) -> tuple[list[int], int, int]:
        """Requests whose segment gap is over (TimelyLLM segments) rejoin the batch.

        They take a slot and memory before any admission: the paper has no
        segments, and a request half answered should not queue behind new ones.
        Returns the rids to resume and what is left of ``free`` and the slots.
        """
        back: list[int] = []
        for s in self.resumable(snap, dec, skip={s.rid for s in stalled}):
            need = s.resume_tokens
            if n >= cap or need > free:
                break
            back.append(s.rid)
            free -= need
            n += 1
        return back, free, n
