"""Images: the executor's state as plain rows, and a fork's books rebuilt from them.

The simulator forks the engine's state to look ahead (:meth:`Images.image`
on the engine, :meth:`Images.restore` on a fresh simulator executor).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from duetime.core.executor_admission import Admission
from duetime.core.executor_state import ExecutorError
from duetime.core.image import EngineImage, LiveSeq
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import Seq, SeqStatus


class Images(Admission):
    """Every request in the system as rows, and the way back."""

    def image(self, now: float | None = None) -> EngineImage:
        """Every request in the system, with what the executor counts of it, at ``now``
        (default: the executor's time; the engine passes its clock's)."""
        rows = []
        waiting = self.waiting
        for group in (self.running.values(), self.suspended.values(), waiting):
            for s in group:
                queue_key = waiting.key_of(s) if s in waiting else None
                rows.append(LiveSeq.of(s, parked=s.rid in self._parked, queue_key=queue_key))
        rows.sort(key=lambda r: r.order)
        return EngineImage(
            now=self.now if now is None else now,
            seqs=tuple(rows),
            kv_capacity=self.kv_capacity,
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            prefix_cache_tokens=(
                self.prefix_cache.capacity_blocks * self.prefix_cache.block_size
                if self.prefix_cache
                else 0
            ),
            prefix_compute_tail=self.prefix_compute_tail,
            offload_suspended=self.offload_suspended,
            share_prefills=self.share_prefills,
            policy=fork() if (fork := getattr(self.policy, "fork", None)) else None,
        )

    def restore(self, image: EngineImage, job_of: Callable[[LiveSeq], Job]) -> None:
        """Take on the requests of ``image`` in the states it gives them, on an executor
        that has none yet (a fork: the simulator, at ``image.now``).

        ``job_of`` says what is taken to be true of each request: its answer's length
        (the engine does not know it: a prediction) and, where known, its segments. A
        length is held to at least one token more than the answer has and at most its
        ``max_tokens`` (segments are then dropped).
        """
        if self.seqs:
            raise ExecutorError("restore() needs an executor with no requests")
        self.now = image.now
        for live in image.seqs:
            req = live.request
            job = job_of(live)
            target = min(req.max_tokens, max(job.output_len, live.generated + 1))
            if target != job.output_len:
                job = Job(req, output_len=target)
            seq = Seq(req, self.clock, live.order)
            seq.prefill_target = live.prefill_target
            seq.prefilled = live.prefilled
            seq.kv_evicted = live.kv_evicted
            seq.kv_offloaded = live.kv_offloaded
            seq.num_preemptions = live.num_preemptions
            seq.first_token_time = live.first_token_time
            seq.segment_index = live.segment_index
            seq.ready_at = live.ready_at
            end = live.segment_end if live.segment_end > live.generated else target
            seq._segment_end = min(end, target)
            seq._set_generated(live.generated)
            self._order = max(self._order, live.order + 1)
            self._jobs[req.rid] = job
            self.seqs[req.rid] = seq
            self.records[req.rid] = RequestRecord(
                request=req,
                target_tokens=target,
                first_token=live.first_token_time,
                num_preemptions=live.num_preemptions,
            )
            seq.status = live.status
            if live.status is SeqStatus.WAITING:
                self.waiting.push(seq, live.queue_key)
            elif live.status is SeqStatus.RUNNING:
                self.running[req.rid] = seq
                if seq.prefill_done:
                    self._start_decoding(seq)
                else:
                    self.prefilling[req.rid] = seq
                    self._static_kv += seq.kv_tokens
            elif live.status is SeqStatus.SUSPENDED:
                self.suspended[req.rid] = seq
                if live.parked:
                    self._parked[req.rid] = seq
                    self._parked_kv += seq.kv_tokens
                elif not live.kv_offloaded:
                    self._static_kv += seq.kv_tokens
                heapq.heappush(self._timers, seq.ready_at)
            else:
                raise ExecutorError(f"request {req.rid} is {live.status.name}: not in a system")
        self._track_peak()
