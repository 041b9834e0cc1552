"""Booking a step and what it ends: tokens, prefills done, stops, segments, finishes.

:meth:`StepBooks._after_step` books one executed step; decoders whose stop
point it reached (a segment's end or the answer's) stop through a heap of stop
steps, so a step costs the stops it reaches. The same ends asked from outside
the policy (a client that leaves, a model that samples end-of-sequence, a
grammar that forces tokens, a stop string) go through the same paths.
"""

from __future__ import annotations

import heapq

from duetime.core.executor_books import KVBooks
from duetime.core.executor_state import ExecutorError
from duetime.core.sequence import Seq, SeqStatus


class StepBooks(KVBooks):
    """A step's books, its stops, and the ends of requests outside the policy."""

    def _cancel(self, seq: Seq) -> None:
        """Cancel a live sequence: its KV memory is freed at once."""
        self._release(seq)
        if seq.status is not SeqStatus.WAITING or seq.kv_offloaded:
            self._drop_kv(seq)
        seq.status = SeqStatus.CANCELLED
        rec = self.records[seq.rid]
        rec.cancelled_at = self.now
        rec.output_tokens = seq.generated
        self.counters["cancelled"] += 1
        self.n_done += 1
        self._policy_forgets(seq.rid)

    # --- outside the policy: clients that leave, answers that end early -------------
    def abort(self, rid: int) -> bool:
        """Cancel request ``rid`` on behalf of its client (a disconnect, a stop string).

        Not a policy decision, so it is never an error: an unknown or already
        finished request is left alone and False returned.
        """
        seq = self.seqs.get(rid)
        if seq is None or seq.status >= SeqStatus.FINISHED:
            return False
        self._cancel(seq)
        return True

    def tokens_left(self, seq: Seq) -> int:
        """Answer tokens ``seq`` may still gain before it stops (its segment's end, or
        its answer's)."""
        return min(self.records[seq.rid].target_tokens, seq._segment_end) - seq.generated

    def skip_ahead(self, rid: int, k: int) -> bool:
        """Book ``k`` more tokens of decoding ``rid``'s answer that take no decode steps
        (tokens a grammar forced, fed with its newest token as one chunk by the step
        under way): its KV holds them but the newest once that step has run, and the
        blocks they fill are offered after it, as a decode step's. Only within
        :meth:`tokens_left` and the free KV memory; False (nothing done) otherwise. A
        sequence that thereby reaches its segment's end or its answer's stops there."""
        seq = self.seqs.get(rid)
        if seq is None or k < 1 or seq.status is not SeqStatus.RUNNING or not seq.decoding:
            return False
        if k > min(self.tokens_left(seq), self.kv_capacity - self.kv_used):
            return False
        self._stop_decoding(seq)
        seq._set_generated(seq.generated + k)
        self._start_decoding(seq)
        self.tokens_generated += k
        self._track_peak()
        self._finish_due()
        return True

    def finish_with(self, rid: int, k: int) -> bool:
        """Finish decoding ``rid`` now, with ``k`` more answer tokens that need no KV (the
        last its grammar forced, or the last ``max_tokens`` allows): as
        :meth:`finish_early` after ``k`` steps, without the steps. False (nothing done)
        unless it is decoding and the tokens stay within its answer."""
        seq = self.seqs.get(rid)
        if seq is None or k < 0 or seq.status is not SeqStatus.RUNNING or not seq.decoding:
            return False
        if k > self.tokens_left(seq):
            return False
        rec = self.records[rid]
        self._stop_decoding(seq)
        seq._set_generated(seq.generated + k)
        self.tokens_generated += k
        rec.target_tokens = seq.generated
        del self.running[rid]
        rec.segment_done.append(self.now)
        self._finish(seq)
        return True

    def finish_early(self, rid: int) -> bool:
        """Finish ``rid`` now with the tokens it has (the model sampled end-of-sequence).

        The record's target becomes the tokens generated, so the request counts
        as finished, not cancelled. Only a sequence with its prefill done can
        end this way; returns False for any other state.
        """
        seq = self.seqs.get(rid)
        if seq is None or not seq.prefill_done:
            return False
        if seq.status is SeqStatus.SUSPENDED:
            self._release(seq)
            self.records[rid].target_tokens = seq.generated
            self._finish(seq)
            return True
        if not (seq.status is SeqStatus.RUNNING and seq.decoding):
            return False
        self.records[rid].target_tokens = seq.generated
        self._reach_stop(seq)
        return True

    def forget(self, rid: int) -> None:
        """Drop every trace of a finished or cancelled request (a long-running server's
        memory); the policy was told when it ended."""
        seq = self.seqs.get(rid)
        if seq is not None and seq.status < SeqStatus.FINISHED:
            raise ExecutorError(f"request {rid} is still {seq.status.name}; abort it first")
        self.seqs.pop(rid, None)
        self.records.pop(rid, None)
        self._jobs.pop(rid, None)

    def _restart(self, seq: Seq) -> None:
        """Discard a released sequence's output: it waits to run again from its prompt."""
        rec = self.records[seq.rid]
        job = self._jobs[seq.rid]
        seq.status = SeqStatus.WAITING
        seq._set_generated(0)
        seq.prefill_target = seq.req.prompt_len
        seq.prefilled = 0
        seq.kv_evicted = 0
        seq.kv_offloaded = False
        seq.first_token_time = rec.first_token = None  # the tokens sent so far are void
        seq.segment_index = 0
        seq.ready_at = seq.req.arrival
        target = rec.target_tokens
        seq._segment_end = min(job.segments[0], target) if job.segments else target
        rec.segment_done.clear()
        rec.segment_ready.clear()
        self.counters["restarts"] = self.counters.get("restarts", 0) + 1
        self._on_restart(seq)
        self.waiting.push(seq)

    def _finish_due(self) -> bool:
        """Handle every decoder whose stop point has been reached. True if any."""
        heap = self._stop_heap
        steps = self.clock.steps
        any_done = False
        while heap and heap[0][0] <= steps:
            _, _, epoch, seq = heapq.heappop(heap)
            if not seq._decoding or seq._epoch != epoch:
                continue  # stale: preempted, suspended or re-started since
            any_done = True
            self._reach_stop(seq)
        return any_done

    def _reach_stop(self, seq: Seq) -> None:
        rid = seq.rid
        rec = self.records[rid]
        target = rec.target_tokens
        self._stop_decoding(seq)
        del self.running[rid]
        rec.segment_done.append(self.now)
        if seq._gen_base >= target:  # (``generated``: it has stopped decoding)
            self._finish(seq)
            return
        job = self._jobs[rid]
        k = seq.segment_index
        gap = job.gap(k)
        nxt = job.segments[k + 1] if k + 1 < len(job.segments) else target
        seq._segment_end = min(seq._segment_end + nxt, target)
        self._suspend_at_boundary(seq, gap, job.gap_estimate(k))

    def _suspend_at_boundary(self, seq: Seq, gap: float, estimate: float | None = None) -> None:
        """Segment boundary: keep the KV; the client wants the next segment after ``gap`` s.

        The client works through its segments in order (a robot runs one action at a
        time): it starts on this one when it has it *and* is done with the previous
        one, so it wants the next at ``max(now, previous want) + gap``. The record
        keeps that true time (scoring); ``seq.ready_at``, what policies see, is the
        same sum over the server's ``estimate`` of the gap (default: the true one).
        """
        rec = self.records[seq.rid]
        wanted = rec.segment_ready[-1] if rec.segment_ready else self.now
        expected = seq.ready_at if seq.segment_index > 0 else self.now
        seq.segment_index += 1
        seq.ready_at = max(self.now, expected) + (gap if estimate is None else estimate)
        rec.segment_ready.append(max(self.now, wanted) + gap)
        seq.status = SeqStatus.SUSPENDED
        self._park(seq)
        self.suspended[seq.rid] = seq
        heapq.heappush(self._timers, seq.ready_at)
        self._on_segment_end(seq)

    def end_segment(self, rid: int, gap: float = 0.0) -> bool:
        """End ``rid``'s current segment now: a text stop checker found a boundary.

        For requests whose segments are not known in advance (``Job.segments``
        empty): the sequence is suspended with its KV, exactly as at a
        trace-given boundary, and the client wants the next segment ``gap`` s
        after it has this one and is done with the previous one
        (:meth:`_suspend_at_boundary`). False (nothing done) unless it is
        decoding and unfinished.
        """
        seq = self.seqs.get(rid)
        if seq is None or seq.status is not SeqStatus.RUNNING or not seq.decoding:
            return False
        if seq.generated >= self.records[rid].target_tokens:
            return False  # its last token: it finishes instead
        self._stop_decoding(seq)
        del self.running[rid]
        self.records[rid].segment_done.append(self.now)
        self._suspend_at_boundary(seq, gap)
        return True

    def _finish(self, seq: Seq) -> None:
        """A released sequence has its whole answer: free its KV and close its record."""
        rec = self.records[seq.rid]
        seq.status = SeqStatus.FINISHED
        if self._chains:
            self._drop_kv(seq)
        else:  # (no prefix-cache chain to drop: only the executor's hook)
            self._on_drop_kv(seq)
        self.n_done += 1
        rec.finish = self.now
        rec.output_tokens = seq.generated
        rec.num_preemptions = seq.num_preemptions
        self._policy_forgets(seq.rid)

    def _policy_forgets(self, rid: int) -> None:
        """Tell the policy that ``rid`` has ended, when it ends: in the simulator and on
        the engine alike (a server later drops the executor's own books: :meth:`forget`)."""
        forget = getattr(self.policy, "forget", None)  # optional in the Policy protocol
        if forget is not None:
            forget(rid)

    def _after_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> None:
        """Book one executed step: decoders took a token (unless they held: a prefill-only
        step, where the decode clock stands still), chunks advanced their prefill."""
        self.engine_steps += 1
        if self._n_dec and not prefill_only:
            self.clock.steps += 1
            self.tokens_generated += self._n_dec
        p_tokens = 0
        for _, n in chunks:
            p_tokens += n
        self.prefill_tokens += p_tokens
        if self.borrowed:  # rows a chunk copied from another were not computed
            self.prefill_tokens -= sum(rows for _, rows in self.borrowed.values())
            self.borrowed = {}
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
        if self._chains:  # (only a prefix cache's chains have blocks to offer)
            self._offer_blocks(chunks)  # before _finish_due frees a finished one's KV
        heap = self._stop_heap
        if heap and heap[0][0] <= self.clock.steps:
            self._finish_due()
