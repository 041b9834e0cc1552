"""The executor core's state: every queue, count and book of one run, and the hooks.

:class:`~duetime.core.executor.ExecutorCore` is built in layers, each a subclass
of the one before and each one job: this state and the hooks an executor with
real memory overrides; the prefix cache's books (``executor_prefix``); the KV
running sums (``executor_books``); booking a step and its stops
(``executor_step``); arrivals and decisions (``executor_admission``); images
(``executor_image``). The layers only call down, so each reads on its own.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypedDict

from duetime.core.policy import Policy
from duetime.core.prefix_cache import PrefixCache, block_key
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import DecodeClock, Seq
from duetime.core.snapshot import EngineSnapshot
from duetime.core.waiting import WaitingQueue

if TYPE_CHECKING:
    from duetime.predict.oracle import JobPredictor


class ExecutorError(RuntimeError):
    """The run cannot make progress (a policy that never schedules, say)."""


class RunCounts(TypedDict):
    """The totals of a run that every executor's result reports under these names (the
    engine's ``EngineResult``, the simulator's ``SimResult``): typed, so mypy checks
    them where :meth:`ExecutorState.run_counts` is unpacked."""

    engine_steps: int
    policy_calls: int
    preemptions: int
    kv_peak: int
    tokens_generated: int
    counters: dict[str, int]


class ExecutorState:
    """Queues, sequences and records of one run; the ``_on_*`` hooks (no-ops here)."""

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
        self.offload_suspended = offload_suspended  # suspended KV may leave the device
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
        self._snap: EngineSnapshot | None = None  # the one snapshot policies are handed

    def run_counts(self) -> RunCounts:
        """The run's totals as its result's keyword arguments: one list for both
        executors, so their results count alike (``counters`` copied)."""
        return RunCounts(
            engine_steps=self.engine_steps,
            policy_calls=self.policy_calls,
            preemptions=self.preemptions,
            kv_peak=self.kv_peak,
            tokens_generated=self.tokens_generated,
            counters=dict(self.counters),
        )

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
