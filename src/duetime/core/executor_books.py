"""The executor's KV books: running sums in tokens, decoders joining and leaving, parking.

KV accounting is lazy: decoding sequences read their counts off the shared
:class:`~duetime.core.sequence.DecodeClock`, and the books keep running sums
(``_n_dec`` decoders whose KV summed to ``_dec_kv_base`` at step ``_dec_mark``;
``_static_kv`` for every other holder), so a step costs O(1), not O(decoders).
Suspended KV is parked (still on the device, off the policy's books) and paged
out only when a step needs the room (:meth:`KVBooks._page_out`).
"""

from __future__ import annotations

import heapq

from duetime.core.executor_prefix import PrefixBooks
from duetime.core.sequence import Seq, SeqStatus


class KVBooks(PrefixBooks):
    """KV tokens on the books and on the device, kept in running sums."""

    def _dec_kv(self) -> int:
        return self._dec_kv_base + self._n_dec * (self.clock.steps - self._dec_mark)

    def _rebase(self) -> None:
        self._dec_kv_base = self._dec_kv()
        self._dec_mark = self.clock.steps

    # (the sums are written out in the properties below: they are read at every
    # scheduling point, where a call more per read shows in a fleet's wall time)
    @property
    def kv_used(self) -> int:
        """KV tokens on the policy's books (parked suspended KV is not)."""
        return (
            self._static_kv + self._dec_kv_base + self._n_dec * (self.clock.steps - self._dec_mark)
        )

    @property
    def kv_device(self) -> int:
        """KV tokens physically on the device: ``kv_used`` plus parked suspended KV."""
        return (
            self._static_kv
            + self._dec_kv_base
            + self._n_dec * (self.clock.steps - self._dec_mark)
            + self._parked_kv
        )

    # --- suspended KV: park on suspend, page out under pressure -----------------
    def _park(self, seq: Seq) -> None:
        """A sequence just became SUSPENDED with its KV on the device."""
        if self.offload_suspended:
            seq.kv_offloaded = True  # the policy's view: off device, resume needs kv + 1
            self._parked[seq.rid] = seq
            self._parked_kv += seq.kv_tokens
        else:
            self._static_kv += seq.kv_tokens

    def _unpark(self, seq: Seq) -> None:
        del self._parked[seq.rid]
        self._parked_kv -= seq.kv_tokens

    def _page_out(self, need: int) -> None:
        """Swap parked KV out until ``need`` tokens on the books fit next to what stays.

        Victims are the parked sequences whose next segment is wanted latest
        (largest ``ready_at``, newest on ties): the ones with the most time to
        come back before anyone waits for them.
        """
        over = need + self._parked_kv - self.kv_capacity
        if over <= 0 or not self._parked:
            return
        victims = sorted(self._parked.values(), key=lambda s: (s.ready_at, s.order), reverse=True)
        for seq in victims:
            if over <= 0:
                break
            kv = seq.kv_tokens
            self._unpark(seq)
            self._on_swap_out(seq)
            self._pending_swap += kv
            self.counters["offloads"] = self.counters.get("offloads", 0) + 1
            over -= kv

    def _start_decoding(self, seq: Seq) -> None:
        steps = self.clock.steps
        n = self._n_dec
        self._dec_kv_base += n * (steps - self._dec_mark)  # (_rebase, written out)
        self._dec_mark = steps
        seq._start_decoding()
        self._n_dec = n + 1
        self._dec_kv_base += seq.kv_tokens
        if self._jobs[seq.rid].ride_rows:
            self._ride += self._ride_rate(seq)
        stop = self._stop_point(seq)
        heapq.heappush(self._stop_heap, (steps + stop - seq.generated, seq.order, seq._epoch, seq))
        if self._chains:
            self._push_block_due(seq)

    def _stop_decoding(self, seq: Seq) -> None:
        steps = self.clock.steps
        n = self._n_dec
        self._dec_kv_base += n * (steps - self._dec_mark) - seq.kv_tokens
        self._dec_mark = steps
        self._n_dec = n = n - 1
        if not n:
            self._ride = 0.0
        elif self._jobs[seq.rid].ride_rows:
            self._ride -= self._ride_rate(seq)
        seq._stop_decoding()

    def _ride_rate(self, seq: Seq) -> float:
        """Rows ``seq``'s forced runs add to each of its decode steps: its job's
        ``ride_rows`` over the steps after its prefill's."""
        rows = self._jobs[seq.rid].ride_rows
        return rows / max(self.records[seq.rid].target_tokens - 1, 1) if rows else 0.0

    def _stop_point(self, seq: Seq) -> int:
        """Generated-token count at which the sequence next stops (segment end or done)."""
        return seq._segment_end

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
            if seq.rid in self._parked:
                self._unpark(seq)
            elif not seq.kv_offloaded:
                self._static_kv -= seq.kv_tokens
            del self.suspended[seq.rid]
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)

    def _track_peak(self) -> None:
        used = (
            self._static_kv
            + self._dec_kv_base
            + self._n_dec * (self.clock.steps - self._dec_mark)
            + self._parked_kv
        )
        if used > self.kv_peak:
            self.kv_peak = used
