"""The state machine both executors share: queues, admission, decisions, stops, KV accounting.

The simulator and the real engine differ only in how a step happens (a cost
model vs. a forward pass) and in what time is (virtual vs. the wall clock).
Everything a policy can observe — the queues, the sequences' counts, free KV
memory, the order decisions are applied in and what is legal — lives in this core, so
the two executors cannot drift apart.

KV accounting is in tokens and lazy (running sums, ``executor_books``).
Subclasses with real memory (the engine) mirror each change through the
``_on_*`` hooks (``executor_state``).

Offload of suspended KV (``offload_suspended``, TimelyLLM §4.1) is the
executor's job, as in the paper, where "the underlying memory management
subsystem" moves a suspended generation's context to host memory. A sequence
that becomes SUSPENDED is *parked*: policies see it as offloaded
(``kv_offloaded``, its KV off ``kv_free``, resuming it needs ``kv_tokens + 1``)
while its KV stays on the device until a step needs the room. Then
``KVBooks._page_out`` swaps parked sequences out, the one whose segment is wanted
latest (largest ``ready_at``) first; a resume brings it back (free if it was
never paged out). Policies stay unchanged and unaware: the same rule runs in
the simulator (swap costed by the cost model) and on the engine (KV spooled to
disk bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from duetime.core.executor_image import Images
from duetime.core.executor_state import ExecutorError
from duetime.core.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from duetime.core.cost import CostModel


__all__ = ["ExecutorCore", "ExecutorError"]


class ExecutorCore(Images):
    """Queues, sequences and records of one run; applies decisions and detects stops.

    Its layers, each a module: ``executor_state`` (state, hooks),
    ``executor_prefix`` (prefix cache, shared prefills), ``executor_books`` (KV
    sums, parking), ``executor_step`` (a step's books and stops),
    ``executor_admission`` (arrivals, decisions), ``executor_image`` (images).
    """

    # --- policy interface ------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The state a policy sees now. One object per executor, brought up to date at
        each call: its containers are the executor's live ones already, so only the
        figures change, and a scheduling point costs no new snapshot."""
        if self._hit_memo:
            self._hit_memo.clear()  # the cache may have changed since the last call
        snap = self._snap
        if snap is None:
            snap = self._snap = EngineSnapshot(
                now=self.now,
                waiting=self.waiting,  # type: ignore[arg-type]
                running=self.running.values(),
                prefilling=self.prefilling.values(),
                suspended=self.suspended.values(),
                kv_capacity=self.kv_capacity,
                kv_free=0,
                max_num_seqs=self.max_num_seqs,
                max_batch_tokens=self.max_batch_tokens,
                prefix_lookup=None if self.prefix_cache is None else self._lookup_hit,
            )
        snap.now = self.now
        snap.kv_capacity = cap = self.kv_capacity
        snap.kv_free = (
            cap
            - self._static_kv
            - self._dec_kv_base
            - self._n_dec * (self.clock.steps - self._dec_mark)
        )
        snap.max_num_seqs = self.max_num_seqs
        snap.max_batch_tokens = self.max_batch_tokens
        snap.num_decoding = self._n_dec
        snap.cost = self.step_cost_model()
        return snap

    def step_cost_model(self) -> CostModel | None:
        """The cost model policies may use to estimate times (None if unknown)."""
        return None

    @property
    def in_system(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.suspended)
