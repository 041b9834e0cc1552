"""The state machine both executors share: queues, admission, decisions, stops, KV accounting.

The simulator and the real engine differ only in how a step happens (a cost
model vs. a forward pass) and in what time is (virtual vs. the wall clock).
Everything a policy can observe — the queues, the sequences' counts, free KV
memory, the order decisions are applied in and what is legal — lives here, so
the two executors cannot drift apart.

KV accounting is in tokens and lazy: decoding sequences read their counts off
the shared :class:`DecodeClock`, and the executor keeps running sums
(``_n_dec`` decoders whose KV summed to ``_dec_kv_base`` at step
``_dec_mark``; ``_static_kv`` for every other holder). Subclasses with real
memory (the engine) mirror each change through the ``_on_*`` hooks.

Offload of suspended KV (``offload_suspended``, TimelyLLM §4.1) is the
executor's job, as in the paper, where "the underlying memory management
subsystem" moves a suspended generation's context to host memory. A sequence
that becomes SUSPENDED is *parked*: policies see it as offloaded
(``kv_offloaded``, its KV off ``kv_free``, resuming it needs ``kv_tokens + 1``)
while its KV stays on the device until a step needs the room. Then
:meth:`_page_out` swaps parked sequences out, the one whose segment is wanted
latest (largest ``ready_at``) first; a resume brings it back (free if it was
never paged out). Policies stay unchanged and unaware: the same rule runs in
the simulator (swap costed by the cost model) and on the engine (KV spooled to
disk bit for bit).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

from duetime.core.decision import Decision
from duetime.core.image import EngineImage, LiveSeq
from duetime.core.policy import Policy, PolicyError
from duetime.core.prefix_cache import (
    DEFAULT_BLOCK_SIZE,
    ROOT_KEY,
    PrefixCache,
    block_key,
    common_prefix_len,
)
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import DecodeClock, Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.core.waiting import WaitingQueue

if TYPE_CHECKING:
    from duetime.core.cost import CostModel
    from duetime.predict.oracle import JobPredictor


class ExecutorError(RuntimeError):
    """The run cannot make progress (a policy that never schedules, say)."""


class ExecutorCore:
    """Queues, sequences and records of one run; applies decisions and detects stops."""

    def __init__(
        self,
        policy: Policy,
        *,
        kv_capacity: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        predictor: JobPredictor | None = None,
        offload_suspended: bool = False,
        prefix_cache_tokens: int = 0,
        prefix_compute_tail: int = 1,
        share_prefills: bool = True,
    ) -> None:
        if prefix_compute_tail < 1:
            raise ValueError(f"prefix_compute_tail must be >= 1, got {prefix_compute_tail}")
        self.policy = policy
        self.offload_suspended = offload_suspended
        self.kv_capacity = kv_capacity
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
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
        self._timers: list[float] = []  # ready_at of suspended sequences
        self._n_dec = 0
        self._dec_kv_base = 0
        self._ride = 0.0  # rows the decoders' forced runs add to each step (Job.ride_rows)
        self._dec_mark = 0
        self._static_kv = 0
        self._parked: dict[int, Seq] = {}  # suspended, offloaded to policies, KV still on device
        self._parked_kv = 0
        self._order = 0
        self._pending_swap = 0  # tokens to move in/out in the next step (costed by the executor)
        self.kv_peak = 0
        self.engine_steps = 0
        self.policy_calls = 0
        self.preemptions = 0
        self.counters: dict[str, int] = {"rejected": 0, "cancelled": 0, "swaps": 0}
        self.n_done = 0  # finished + cancelled
        self.tokens_generated = 0  # every output token produced
        self.prefill_tokens = 0  # every prompt (or recomputed) token run through prefill
        self.prefill_cached_tokens = 0  # prefill tokens whose KV a prefix cache supplied
        # Prefills of one step that start alike compute their common tokens once
        # (:meth:`_share_prefills`): rid → (the chunk it borrows from, rows borrowed),
        # for the step being run; the rows count in prefill_shared_tokens.
        self.share_prefills = share_prefills
        self.borrowed: dict[int, tuple[int, int]] = {}
        self.prefill_shared_tokens = 0
        # Automatic prefix caching (core/prefix_cache.py): the books are kept here, for
        # both executors; what a block holds is the executor's (_block_payload).
        self.prefix_cache: PrefixCache[Any] | None = (
            PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        )
        self.prefix_compute_tail = prefix_compute_tail  # prompt tokens a hit leaves to compute
        # rid → (its whole blocks offered to the prefix cache, the last one's key); only
        # while its KV is every position's own (an evicted sequence's is not: it leaves)
        self._chains: dict[int, tuple[int, Hashable]] = {}
        # (decode step, order, epoch, seq): when a decoder completes its next block
        self._block_due: list[tuple[int, int, int, Seq]] = []
        # rid → its prefix hit, looked up for this scheduling point's policy (the cache
        # does not change between the policy's call and the decision's admissions)
        self._hit_memo: dict[int, int] = {}

    # --- hooks for executors with real memory (no-ops here) --------------------
    def _on_admit(self, seq: Seq, prefix: list[Any]) -> int:
        """A WAITING sequence is about to get KV memory (its first prefill chunk).

        ``prefix`` holds the payloads of the prefix-cache blocks its prefill begins
        with (:meth:`_prefix_hit`). Returns how many of its first tokens thereby
        have their KV (fewer than ``prefill_target``): their prefill is skipped. The
        policy reserved memory for the whole prefill, so a hit never needs more.
        """
        return len(prefix) * self.prefix_cache.block_size if self.prefix_cache else 0

    def _block_key(self, seq: Seq, start: int, end: int, parent: Hashable) -> Hashable:
        """The prefix-cache key of the block of positions ``[start, end)`` of ``seq``'s
        tokens (prompt, then answer), after the blocks keyed ``parent``.

        What the core knows of a sequence's tokens: its prompt ids when the request
        carries them, else the shared prefix it names (``prefix_group``, the first
        ``prefix_len`` tokens); any other block is the request's own, which only its
        own recomputation can reuse. The engine, which has every token, hashes them.
        """
        req = seq.req
        ids = req.prompt_token_ids
        if ids is not None:
            if end <= len(ids) and isinstance(parent, bytes):
                return block_key(parent, ids[start:end])
        elif req.prefix_group is not None and end <= req.prefix_len:
            return ("prefix", req.prefix_group, start)
        return ("own", seq.rid, start)

    def _block_payload(self, seq: Seq, start: int, end: int) -> Any:
        """What the prefix cache keeps of positions ``[start, end)`` of ``seq`` (the
        engine: their K/V; a simulator: nothing)."""
        return None

    def _on_drop_kv(self, seq: Seq) -> None:
        """The sequence's KV is gone for good (finish, cancel, recompute preemption)."""

    def _on_swap_out(self, seq: Seq) -> None:
        """The sequence's KV leaves device memory but is kept."""

    def _on_swap_in(self, seq: Seq) -> None:
        """An offloaded sequence's KV comes back."""

    def _on_evict(self, seq: Seq, n_tokens: int, alpha: float) -> None:
        """``n_tokens`` of the sequence's KV were evicted at ratio ``alpha``."""

    def _on_restart(self, seq: Seq) -> None:
        """The sequence's output was discarded; it will start again from its prompt."""

    def _on_segment_end(self, seq: Seq) -> None:
        """The sequence reached a segment boundary and is now SUSPENDED."""

    # --- prefix caching ----------------------------------------------------------
    def _block_keys(self, seq: Seq, n_blocks: int) -> Iterator[Hashable]:
        """Keys of ``seq``'s first ``n_blocks`` blocks, one at a time (a lookup stops at
        its first miss)."""
        if self.prefix_cache is None:
            return
        size = self.prefix_cache.block_size
        parent: Hashable = ROOT_KEY
        for start in range(0, n_blocks * size, size):
            parent = self._block_key(seq, start, start + size, parent)
            yield parent

    def _hit_limit(self, seq: Seq) -> int:
        """The most of ``seq``'s prefill a hit may cover: all but the last
        ``prefix_compute_tail`` tokens (the last one's logits give the next token; the
        engine under SnapKV needs its query window's too)."""
        return max(0, seq.prefill_target - self.prefix_compute_tail)

    def _lookup_hit(self, seq: Seq) -> int:
        """What :meth:`_prefix_hit` would find for ``seq`` now, in tokens, without
        counting or marking anything (the snapshot's ``prefix_hit``); 0 unless waiting."""
        cache = self.prefix_cache
        if cache is None or seq.status is not SeqStatus.WAITING:
            return 0
        hit = self._hit_memo.get(seq.rid)
        if hit is None:
            n_blocks = self._hit_limit(seq) // cache.block_size
            hit = self._hit_memo[seq.rid] = cache.peek(self._block_keys(seq, n_blocks))
        return hit

    def _prefix_hit(self, seq: Seq) -> list[Any]:
        """Look the prefill of a sequence about to be admitted up in the prefix cache:
        the payloads of the cached blocks it begins with (at most :meth:`_hit_limit`)."""
        cache = self.prefix_cache
        if cache is None:
            return []
        limit = self._hit_limit(seq)
        keys, payloads = cache.match(self._block_keys(seq, limit // cache.block_size), limit)
        self._chains[seq.rid] = (len(keys), keys[-1] if keys else ROOT_KEY)
        return payloads

    def _offer_blocks(self, chunks: list[tuple[Seq, int]]) -> None:
        """Offer the prefix cache every whole block a step (or a run of decode steps) just
        completed: of the prefill ``chunks``, and of the decoders due one (prompt and
        answer alike: a conversation's next turn begins with both). Decoders are found
        through a heap of the step each completes its next block at, so a run of steps
        costs the blocks it completes, not one look at every sequence a step."""
        if self.prefix_cache is None or not self._chains:
            return
        for seq, _ in chunks:
            if not seq.prefill_done:  # a finished prefill joined the decoders, below
                self._offer_seq(seq)
        due, steps = self._block_due, self.clock.steps
        size = self.prefix_cache.block_size
        while due and due[0][0] <= steps:
            at, _, epoch, seq = heapq.heappop(due)
            if seq.decoding and seq._epoch == epoch:
                # A run of several steps (the simulator's) completes a decoder's blocks a
                # block's worth of steps apart: offer those done before the next decoder's
                # is due, so that the blocks go in in the order a step at a time gives.
                until = steps if not due else min(steps, due[0][0] - 1)
                self._offer_seq(seq, most=1 + max(0, until - at) // size)
                self._push_block_due(seq)

    def _offer_seq(self, seq: Seq, most: int | None = None) -> None:
        """Offer every whole block (at most ``most``) of ``seq`` its KV holds that it has
        not offered yet."""
        chain = self._chains.get(seq.rid)
        cache = self.prefix_cache
        if chain is None or cache is None:
            return  # its KV is not its prefill's any more (evicted): it offers nothing
        size = cache.block_size
        done, parent = chain
        end = self._kv_positions(seq)
        if most is not None:
            end = min(end, (done + most) * size)
        while (done + 1) * size <= end:
            start = done * size
            key = self._block_key(seq, start, start + size, parent)
            if key not in cache:  # (reading a block's KV costs a copy: only when new)
                cache.insert(key, parent, self._block_payload(seq, start, start + size))
            parent, done = key, done + 1
        self._chains[seq.rid] = (done, parent)

    @staticmethod
    def _kv_positions(seq: Seq) -> int:
        """Positions a running sequence's KV holds (a decoder's newest token is produced
        but not yet fed back)."""
        return seq.req.prompt_len + seq.generated - 1 if seq.prefill_done else seq.prefilled

    def _push_block_due(self, seq: Seq) -> None:
        """A decoder with a chain: note the decode step it completes its next block at."""
        chain = self._chains.get(seq.rid)
        if chain is None or self.prefix_cache is None:
            return
        ahead = (chain[0] + 1) * self.prefix_cache.block_size - self._kv_positions(seq)
        heapq.heappush(self._block_due, (self.clock.steps + ahead, seq.order, seq._epoch, seq))

    def _drop_kv(self, seq: Seq) -> None:
        """The sequence's KV is gone for good: it offers the prefix cache nothing more."""
        self._chains.pop(seq.rid, None)
        self._on_drop_kv(seq)

    # --- policy interface ------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        self._hit_memo.clear()  # the cache may have changed since the last call
        return EngineSnapshot(
            now=self.now,
            waiting=self.waiting,  # type: ignore[arg-type]
            running=self.running.values(),  # type: ignore[arg-type]
            prefilling=self.prefilling.values(),  # type: ignore[arg-type]
            suspended=self.suspended.values(),  # type: ignore[arg-type]
            kv_capacity=self.kv_capacity,
            kv_free=self.kv_capacity - self.kv_used,
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            num_decoding=self._n_dec,
            cost=self.step_cost_model(),
            prefix_lookup=None if self.prefix_cache is None else self._lookup_hit,
        )

    def step_cost_model(self) -> CostModel | None:
        """The cost model policies may use to estimate times (None if unknown)."""
        return None

    @property
    def in_system(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.suspended)

    # --- running sums -------------------------------------------------------
    def _dec_kv(self) -> int:
        return self._dec_kv_base + self._n_dec * (self.clock.steps - self._dec_mark)

    def _rebase(self) -> None:
        self._dec_kv_base = self._dec_kv()
        self._dec_mark = self.clock.steps

    @property
    def kv_used(self) -> int:
        """KV tokens on the policy's books (parked suspended KV is not)."""
        return self._static_kv + self._dec_kv()

    @property
    def kv_device(self) -> int:
        """KV tokens physically on the device: ``kv_used`` plus parked suspended KV."""
        return self._static_kv + self._dec_kv() + self._parked_kv

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
        self._rebase()
        seq._start_decoding()
        self._n_dec += 1
        self._dec_kv_base += seq.kv_tokens
        self._ride += self._ride_rate(seq)
        stop = self._stop_point(seq)
        heapq.heappush(
            self._stop_heap, (self.clock.steps + stop - seq.generated, seq.order, seq._epoch, seq)
        )
        if self._chains:
            self._push_block_due(seq)

    def _stop_decoding(self, seq: Seq) -> None:
        self._rebase()
        self._dec_kv_base -= seq.kv_tokens
        self._n_dec -= 1
        self._ride = self._ride - self._ride_rate(seq) if self._n_dec else 0.0
        seq._stop_decoding()

    def _ride_rate(self, seq: Seq) -> float:
        """Rows ``seq``'s forced runs add to each of its decode steps: its job's
        ``ride_rows`` over the steps after its prefill's."""
        rows = self._jobs[seq.rid].ride_rows
        return rows / max(self.records[seq.rid].target_tokens - 1, 1) if rows else 0.0

    def _stop_point(self, seq: Seq) -> int:
        """Generated-token count at which the sequence next stops (segment end or done)."""
        return seq.segment_end

    # --- arrivals ---------------------------------------------------------------
    def admit_arrival(self, job: Job) -> None:
        req = job.request
        if req.rid in self.seqs:
            raise ExecutorError(f"duplicate request id {req.rid}")
        if self.predictor is not None and req.predicted is None:
            req.predicted = self.predictor.predict_job(job)
        seq = Seq(req, self.clock, self._order)
        target = min(job.output_len, req.max_tokens)
        seq.segment_end = min(job.segments[0], target) if job.segments else target
        rec = RequestRecord(request=req, target_tokens=target)
        never_fits = req.prompt_len + 1 > self.kv_capacity
        if not never_fits:
            # Queued before it is registered: a policy's waiting key that raises (hsf with
            # no length prediction) must leave no trace, or a server that refuses the
            # request and goes on would hold it, unreachable and unfinished, for good.
            self.waiting.push(seq)
        self._order += 1
        self._jobs[req.rid] = job
        self.seqs[req.rid] = seq
        self.records[req.rid] = rec
        if never_fits:
            # Can never fit: refuse at once, as vLLM rejects prompts over max_model_len.
            seq.status = SeqStatus.CANCELLED
            rec.cancelled_at = self.now
            self.counters["rejected"] += 1
            self.n_done += 1

    # --- images: the state as plain rows, and a fork's books rebuilt from them -------
    def image(self, now: float | None = None) -> EngineImage:
        """Every request in the system, with what the executor counts of it, at ``now``
        (default: the executor's time; the engine passes its clock's)."""
        rows = []
        waiting = self.waiting
        for group in (self.running.values(), self.suspended.values(), waiting):
            for s in group:
                rows.append(
                    LiveSeq(
                        request=s.req,
                        status=s.status,
                        order=s.order,
                        prefill_target=s.prefill_target,
                        prefilled=s.prefilled,
                        generated=s.generated,
                        kv_evicted=s.kv_evicted,
                        kv_offloaded=s.kv_offloaded,
                        parked=s.rid in self._parked,
                        ready_at=s.ready_at,
                        segment_index=s.segment_index,
                        segment_end=s.segment_end,
                        first_token_time=s.first_token_time,
                        num_preemptions=s.num_preemptions,
                        queue_key=waiting.key_of(s) if s in waiting else None,
                    )
                )
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
            seq.segment_end = min(end, target)
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
            if seq.rid in self._parked:
                self._unpark(seq)
            elif not seq.kv_offloaded:
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
            self._cancel(seq)
        for rid in dec.preempt:
            seq = self._get(rid, "preempt")
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.SUSPENDED):
                raise PolicyError(f"policy {name!r}: preempt of {seq.status.name} request {rid}")
            if dec.preempt_mode == "swap" and seq.kv_offloaded:
                continue  # suspended and already off the books: nothing to move
            kv = seq.kv_tokens
            self._release(seq)
            self.preemptions += 1
            seq.num_preemptions += 1
            if dec.preempt_mode == "swap" and seq.prefill_done:
                self._on_swap_out(seq)
                seq.status = SeqStatus.SUSPENDED
                seq.kv_offloaded = True
                self.suspended[rid] = seq
                self._pending_swap += kv
                self.counters["swaps"] += 1
            elif dec.preempt_mode == "restart":
                self._drop_kv(seq)
                self._restart(seq)
            else:  # recompute: recompute prompt + generated tokens later
                self._drop_kv(seq)
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
            seq.status = SeqStatus.SUSPENDED
            self._park(seq)
            self.suspended[rid] = seq
        for rid in dec.resume:
            seq = self._get(rid, "resume")
            if seq.status is not SeqStatus.SUSPENDED:
                raise PolicyError(f"policy {name!r}: resume of {seq.status.name} request {rid}")
            del self.suspended[rid]
            if seq.rid in self._parked:
                self._unpark(seq)  # never paged out: the KV is still on the device
                seq.kv_offloaded = False
            elif seq.kv_offloaded:
                self._on_swap_in(seq)
                seq.kv_offloaded = False
                self._pending_swap += seq.kv_tokens
                self.counters["swap_ins"] = self.counters.get("swap_ins", 0) + 1
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
            self._chains.pop(rid, None)  # its later blocks would not be a full prefill's
            self._on_evict(seq, n, alpha)
            seq.kv_evicted += n
            if seq.decoding:
                self._rebase()
                self._dec_kv_base -= n
            elif seq.rid in self._parked:
                self._parked_kv -= n
            elif not seq.kv_offloaded:
                self._static_kv -= n
            self.records[rid].kv_evicted_ratio = alpha
        chunks: list[tuple[Seq, int]] = []
        named: set[int] = set()
        for rid, n in dec.prefill:
            seq = self._get(rid, "prefill")
            if rid in named:
                # Both chunks would start where the prefill stands: the same tokens twice
                # (the engine's cache would store them twice, the books count them twice).
                raise PolicyError(f"policy {name!r}: prefill of request {rid} twice in one step")
            named.add(rid)
            if seq.status is SeqStatus.WAITING:
                cached = self._on_admit(seq, self._prefix_hit(seq))
                if not 0 <= cached < seq.prefill_target:  # the step must compute a token
                    raise ExecutorError(
                        f"request {rid}: {cached} cached tokens of a {seq.prefill_target}-token "
                        "prefill (a hit must leave at least one token to compute)"
                    )
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running[rid] = seq
                self.prefilling[rid] = seq
                if cached:
                    seq.prefilled = cached
                    self._static_kv += cached
                    self.prefill_cached_tokens += cached
                self.records[rid].cached_prompt_tokens = min(cached, seq.req.prompt_len)
            elif seq.status is not SeqStatus.RUNNING or seq.prefill_done:
                raise PolicyError(f"policy {name!r}: prefill of request {rid} in {seq!r}")
            n = seq.prefill_remaining if n <= 0 else min(n, seq.prefill_remaining)
            chunks.append((seq, n))
        self._share_prefills(chunks)
        return chunks

    # --- prefills shared within a step -------------------------------------------
    def _share_prefills(self, chunks: list[tuple[Seq, int]]) -> None:
        """Let a chunk borrow the rows an earlier chunk of the same step computes.

        ``n > 1`` choices of one prompt, or a burst of requests behind one system
        prompt, are admitted together: the prefix cache cannot help (their blocks
        exist only after the step), so each would compute the same tokens. A chunk
        that starts where an earlier one does, after the same tokens, and goes on
        with the same tokens, takes those rows' keys and values from it and computes
        only the rest (at least its last token, whose logits it needs): its
        prefill still advances by its whole chunk, so policies see nothing but a
        cheaper step. Only rows of at least a block's worth
        (``DEFAULT_BLOCK_SIZE``) are borrowed, from a chunk that computes its own.
        """
        if self.borrowed:
            self.borrowed = {}
        if len(chunks) < 2 or not self.share_prefills:
            return
        # Chunks that can share begin alike where they start: bucketing them by that
        # first block keeps a step of k unrelated chunks at k lookups, not k² comparisons.
        leaders: dict[Hashable, list[tuple[Seq, int]]] = {}
        for seq, n in chunks:
            key = self._share_key(seq) if n > DEFAULT_BLOCK_SIZE else None
            if key is None:
                continue
            best, rows = None, 0
            if self._may_borrow(seq):
                start = seq.prefilled
                for lead, m in leaders.get(key, ()):
                    common = self._common_prompt(lead, seq, start + min(m, n - 1)) - start
                    if common >= DEFAULT_BLOCK_SIZE and common > rows:
                        best, rows = lead, common
            if best is None:
                leaders.setdefault(key, []).append((seq, n))
            else:
                self.borrowed[seq.rid] = (best.rid, rows)
                self.prefill_shared_tokens += rows

    @staticmethod
    def _share_key(seq: Seq) -> Hashable | None:
        """Where ``seq``'s prefill stands and the block of prompt it goes on with (its
        ids, or the shared prefix it names); None where no block of prompt is left."""
        req, start = seq.req, seq.prefilled
        end = start + DEFAULT_BLOCK_SIZE
        ids = req.prompt_token_ids
        if ids is not None:
            return (start, tuple(ids[start:end])) if end <= len(ids) else None
        if req.prefix_group is not None and end <= req.prefix_len:
            return (start, "group", req.prefix_group)
        return None

    def computed_rows(self, seq: Seq, n: int) -> int:
        """Rows the step's prefill chunk of ``n`` tokens of ``seq`` computes: all but
        those it borrows from another chunk."""
        lent = self.borrowed.get(seq.rid)
        return n if lent is None else n - lent[1]

    def _may_borrow(self, seq: Seq) -> bool:
        """Whether ``seq``'s prefill may take rows another chunk computes (the engine
        says no where it needs every row's own output)."""
        return True

    @staticmethod
    def _common_prompt(a: Seq, b: Seq, end: int) -> int:
        """How many first tokens the prompts of ``a`` and ``b`` agree on, at most
        ``end``: their ids where both requests carry them, else the shared prefix
        they both name (``prefix_group``); 0 where nothing says they agree."""
        ra, rb = a.req, b.req
        end = min(end, ra.prompt_len, rb.prompt_len)
        ia, ib = ra.prompt_token_ids, rb.prompt_token_ids
        if ia is not None and ib is not None:
            return common_prefix_len(ia, ib, end)
        if ra.prefix_group is not None and ra.prefix_group == rb.prefix_group:
            return min(end, ra.prefix_len, rb.prefix_len)
        return 0

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
        return min(self.records[seq.rid].target_tokens, seq.segment_end) - seq.generated

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
        """Drop every trace of a finished or cancelled request (a long-running server's memory)."""
        seq = self.seqs.get(rid)
        if seq is not None and seq.status < SeqStatus.FINISHED:
            raise ExecutorError(f"request {rid} is still {seq.status.name}; abort it first")
        self.seqs.pop(rid, None)
        self.records.pop(rid, None)
        self._jobs.pop(rid, None)
        forget = getattr(self.policy, "forget", None)  # optional in the Policy protocol
        if forget is not None:
            forget(rid)

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
        seq.segment_end = min(job.segments[0], target) if job.segments else target
        rec.segment_done.clear()
        rec.segment_ready.clear()
        self.counters["restarts"] = self.counters.get("restarts", 0) + 1
        self._on_restart(seq)
        self.waiting.push(seq)

    def _check_limits(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> None:
        name = self.policy.name
        if prefill_only and not chunks:
            raise PolicyError(f"policy {name!r}: a prefill-only step without a prefill")
        p_tokens = sum(n for _, n in chunks)
        n_dec = 0 if prefill_only else self._n_dec
        if p_tokens + n_dec > self.max_batch_tokens:
            raise PolicyError(
                f"policy {name!r}: step has {p_tokens} prefill + {n_dec} decode tokens, "
                f"over max_batch_tokens={self.max_batch_tokens}"
            )
        if len(self.running) > self.max_num_seqs:
            raise PolicyError(
                f"policy {name!r}: {len(self.running)} running sequences, "
                f"over max_num_seqs={self.max_num_seqs}"
            )
        need = self.kv_used + p_tokens + n_dec
        if need > self.kv_capacity:
            raise PolicyError(
                f"policy {name!r}: next step needs {need} KV tokens, "
                f"capacity is {self.kv_capacity} (at t={self.now:.3f}s)"
            )
        if self._parked:
            self._page_out(need)

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
            self._finish(seq)
            return
        k = seq.segment_index
        gap = job.gap(k)
        nxt = job.segments[k + 1] if k + 1 < len(job.segments) else target
        seq.segment_end = min(seq.segment_end + nxt, target)
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
        self._drop_kv(seq)
        self.n_done += 1
        rec.finish = self.now
        rec.output_tokens = seq.generated
        rec.num_preemptions = seq.num_preemptions

    def _after_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> None:
        """Book one executed step: decoders took a token (unless they held: a prefill-only
        step, where the decode clock stands still), chunks advanced their prefill."""
        self.engine_steps += 1
        if self._n_dec and not prefill_only:
            self.clock.steps += 1
            self.tokens_generated += self._n_dec
        p_tokens = sum(n for _, n in chunks)
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
        self._offer_blocks(chunks)  # before _finish_due frees a finished one's KV
        self._finish_due()

    def _track_peak(self) -> None:
        used = self.kv_device
        if used > self.kv_peak:
            self.kv_peak = used
