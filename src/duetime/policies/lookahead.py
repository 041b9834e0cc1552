"""The scheduler shared by H-SF, Amax, Amin and A_ℓ (Chen, Ye, Zhou 2025, arXiv:2508.14544).

All four are one loop with a different *assumed output length*:

1. give up the sequences the policy no longer wants (A_ℓ's promotion);
2. if the next step needs more KV than is free, cancel sequences, in the
   policy's victim order, until it fits (a paper "cancellation": the job
   restarts from scratch, ``preempt_mode="restart"``);
3. admit waiting sequences in queue order (smallest assumed length first)
   while each one, run for its assumed length, keeps every future step within
   memory next to the running ones run for theirs (Eq. 3, see
   :mod:`duetime.policies.future_memory`); one that does not fit is skipped
   (A_ℓ stops there instead, as the paper's queue does);
4. if one that did not fit would fit after a few steps with no other event,
   ask to be woken then: the paper's scheduler acts at every step, ours at
   events.

A sequence restarted in steps 1–2 is waiting again once the decision is
applied (executors apply ``preempt`` before ``prefill``, and a restart leaves
it WAITING), so it can be named for admission in the same decision. A policy
that sets :attr:`LookaheadPolicy.readmit_restarted` (A_ℓ: Alg. 6 moves a
promoted request "to the end of R_t" and then fills the batch "from the front
of R_t") offers it behind the waiting queue in this very call; for the others
(Amin's Alg. 2 takes ``R_t`` as it was before the removals) it joins the queue
for the next step, so the call asks to be woken one step ahead. Either way a
restarted request never waits for an unrelated event.

A subclass sets :meth:`assumed_len`; the ordering key and the victim order
follow from it. Policies read only ``Request.predicted`` and the counts of a
sequence, never the hidden true length.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any

from duetime.core.decision import Decision
from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy
from duetime.policies.future_memory import FutureMemory, tiebreak


def lower_bound(seq: Seq) -> int:
    """The predicted interval's lower end as a whole number of tokens (>= 1)."""
    p = seq.req.predicted
    return 1 if p is None else max(1, math.ceil(p.lo - 1e-9))


def upper_bound(seq: Seq) -> int:
    """The predicted interval's upper end as a whole number of tokens (>= 1); max_tokens if none."""
    p = seq.req.predicted
    if p is None:
        return seq.req.max_tokens
    return max(1, math.floor(p.hi + 1e-9))


class LookaheadPolicy(QueuePolicy):
    """Shortest assumed length first, admitting only what fits for its whole assumed life."""

    name = "lookahead"
    sorted_by_length = True  # the waiting queue is in ascending assumed length
    # Offer what a call restarts behind the waiting queue in the same call (see the
    # module docstring); needs :meth:`fresh_len` and ``preempt_mode="restart"``.
    readmit_restarted = False

    def __init__(self, *, seed: int = 0, max_skip: int = 64, **kwargs: Any) -> None:
        # Skip a request that does not fit and try the next: with uneven prompts a
        # long one at the head would otherwise idle the memory the rest could use.
        kwargs.setdefault("head_of_line_blocking", False)
        kwargs.setdefault("chunked_prefill", False)
        kwargs.setdefault("preempt_mode", "restart")
        super().__init__(**kwargs)
        self.seed = seed
        self.max_skip = max_skip  # requests skipped per scheduling point before giving up

    # --- the choice a subclass makes -----------------------------------------
    def assumed_len(self, seq: Seq) -> int:
        """Output tokens the policy assumes ``seq`` produces in all (> generated)."""
        raise NotImplementedError

    def fresh_len(self, seq: Seq) -> int:
        """Output tokens assumed for ``seq`` started over, after :meth:`on_cancel` saw it.

        :meth:`assumed_len` cannot say: the snapshot still shows the tokens the
        restart throws away. Only a policy with :attr:`readmit_restarted` needs it.
        """
        raise NotImplementedError

    def waiting_key(self, seq: Seq) -> Any:
        return (self.assumed_len(seq), tiebreak(self.seed, seq.rid))

    def victim_key(self, seq: Seq, now: float) -> Any:
        """Larger = cancelled first. Default: the most recently admitted."""
        return seq.order

    def give_up(self, snap: EngineSnapshot) -> list[Seq]:
        """Running sequences to cancel before anything else (none by default)."""
        return []

    def on_cancel(self, seq: Seq) -> None:
        """Called for each sequence this policy restarts, before the decision is applied."""

    def next_wake(self, snap: EngineSnapshot) -> int | None:
        """Steps until the policy wants to look again for its own reasons (None: no reason)."""
        return None

    # --- the loop ----------------------------------------------------------------
    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = Decision(preempt_mode=self.preempt_mode)
        free, decoders, n_seqs = snap.kv_free, snap.num_decoding, len(snap.running)
        gone: set[int] = set()
        restarted: list[Seq] = []  # in dec.preempt order: the order they rejoin the queue

        def cancel(seq: Seq) -> None:
            nonlocal free, decoders, n_seqs
            kv = seq.kv_tokens
            if n_seqs == 1 and kv + 1 > snap.kv_capacity:
                dec.cancel.append(seq.rid)  # cannot take one more token even alone
            else:
                self.on_cancel(seq)
                dec.preempt.append(seq.rid)
                restarted.append(seq)
            gone.add(seq.rid)
            free += kv
            decoders -= 1 if seq.prefill_done else 0
            n_seqs -= 1

        for seq in self.give_up(snap):
            cancel(seq)
        if decoders > free:
            now = snap.now
            victims = sorted(
                (s for s in snap.running if s.rid not in gone),
                key=lambda s: self.victim_key(s, now),
                reverse=True,
            )
            for v in victims:
                if decoders <= free:
                    break
                cancel(v)

        # The running set, each for the rest of its assumed life.
        used = snap.kv_capacity - snap.kv_free
        rs: list[int] = []
        cs: list[int] = []
        dec_kv = 0
        assumed = self.assumed_len
        for s in snap.running:
            kv = s.kv_tokens
            used -= kv
            if s.rid in gone:
                continue
            rs.append(assumed(s) - s.generated)
            if s.prefilled >= s.prefill_target:  # prefill_done, without the property call
                cs.append(kv + 1)
                dec_kv += kv
            else:
                cs.append(s.prefill_target)
        mem = FutureMemory(snap.kv_capacity, static=used)
        mem.extend(rs, cs)

        free -= decoders
        resumed, free = self._resume(snap, dec, mem, free, n_seqs)
        decoders += len(resumed)
        dec_kv += sum(s.kv_tokens for s in resumed)
        n_seqs += len(resumed)
        budget = snap.max_batch_tokens - decoders
        for seq in snap.prefilling:  # chunked prefills in progress (none unless enabled)
            if seq.rid not in gone and budget > 0:
                n = min(seq.prefill_remaining, budget, free)
                if n > 0:
                    dec.prefill.append((seq.rid, n))
                    budget -= n
                    free -= n

        # Restarted in this call: offered again behind the queue (their restart resets
        # them to the prompt and no tokens), or looked at again one step from now.
        again = restarted if self.readmit_restarted and self.preempt_mode == "restart" else []
        missed: list[tuple[int, int]] = []  # (r, c) of the first few that did not fit
        misses = 0
        for seq in chain(snap.waiting, again):
            if n_seqs >= snap.max_num_seqs:
                break
            if seq.rid in gone:
                need, r = seq.req.prompt_len, self.fresh_len(seq)
            else:
                need, r = seq.prefill_target, self.assumed_len(seq) - seq.generated
            allowed = min(mem.allowance(r), free)
            room = min(allowed, budget)
            alone = n_seqs == 0 and not dec.prefill  # nothing else could ever make room
            # The whole prompt in one step (less a prefix-cache hit), unless chunked
            # prefill is on or it is longer than any step takes; memory is reserved
            # for all of it either way.
            step = self.first_chunk(seq, snap, need, budget)
            fits = need <= allowed or (alone and need <= free)
            if fits and 1 <= step <= budget:
                dec.prefill.append((seq.rid, step))
                mem.add(r, need)
                budget -= step
                free -= need
                n_seqs += 1
                continue
            if len(missed) < 2:
                missed.append((r, need))
            if self.head_of_line_blocking:
                break
            # The queue is in ascending assumed length and the room only shrinks
            # with it: once not even one token fits, nothing further down will.
            misses += 1
            if (self.sorted_by_length and room < 1) or misses >= self.max_skip:
                break

        if not dec.prefill:  # (a prefill step is followed by a call anyway)
            waits = [self.next_wake(snap)]
            if restarted and not again:
                waits.append(1)  # they are in the queue from the next step on
            if n_seqs < snap.max_num_seqs:
                waits += [mem.earliest_start(r, c) for r, c in missed]
            j = min((w for w in waits if w is not None), default=None)
            if j is not None:
                dec.wake_at = _step_time(snap, j, decoders, dec_kv)
        if not (dec.prefill or dec.resume or decoders > 0 or dec.cancel or dec.preempt):
            # Suspended requests hold the memory that they and the queue need.
            victim = self._break_deadlock(snap, dec)
            if victim is not None:
                self.on_cancel(victim)
        return dec

    def _resume(
        self, snap: EngineSnapshot, dec: Decision, mem: FutureMemory, free: int, n_seqs: int
    ) -> tuple[list[Seq], int]:
        """Resume suspended sequences whose segment gap is over, if their assumed rest fits.

        A resumed sequence's KV moves from the static part of ``mem`` into the
        batch; alone in the engine it resumes whenever its next token fits, as
        admission does, so a segmented request can never wait forever. Returns
        the sequences resumed and what is left of ``free``.
        """
        resumed: list[Seq] = []
        for s in self.resumable(snap, dec):
            if n_seqs >= snap.max_num_seqs:
                break
            held = 0 if s.kv_offloaded else s.kv_tokens
            need = s.resume_tokens
            r = self.assumed_len(s) - s.generated
            mem.static -= held
            if need <= free and (s.kv_tokens + 1 <= mem.allowance(r) or n_seqs == 0):
                mem.add(r, s.kv_tokens + 1)
                dec.resume.append(s.rid)
                resumed.append(s)
                free -= need
                n_seqs += 1
                continue
            mem.static += held
            break
        return resumed, free


def _step_time(snap: EngineSnapshot, j: int, decoders: int, kv: int) -> float | None:
    """A time inside the j-th step from now, for a fixed batch.

    Executors run every step that ends before a wake-up plus the one that
    crosses it, so waking mid-step stops them after exactly ``j`` steps.
    """
    cost = snap.cost
    if cost is None or decoders <= 0:
        return None
    before = cost.decode_span(j - 1, decoders, kv)
    return snap.now + (before + cost.decode_span(j, decoders, kv)) / 2
