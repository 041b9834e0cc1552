"""The engine state a policy sees. Identical in shape for the simulator and the engine."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duetime.core.sequence import Seq

if TYPE_CHECKING:
    from duetime.core.cost import CostModel


@dataclass(slots=True)
class EngineSnapshot:
    """State at one scheduling point. Read-only for policies.

    ``waiting`` is ordered by the policy's own ``waiting_key`` (executors keep
    it sorted; it takes an index or a slice), ``running`` and ``suspended`` in
    admission order; ``prefilling`` is the subset of ``running`` whose prefill is
    unfinished (chunked prefill in progress). These three are views of the
    executor's dicts: iterate them or take their ``len``, not an index
    (``list(snap.running)[-1]`` is the newest admitted). All four are the executor's
    live containers, not copies (a copy per step would cost more than the step):
    never mutate them. For the same reason an executor hands its
    policy one snapshot object, brought up to date at each scheduling point: a
    policy reads it during ``schedule`` and keeps none of it. ``kv_free`` and ``kv_capacity`` count
    tokens. ``cost`` is the executor's step-cost model (the fitted profile on
    the real engine), so a policy can estimate execution times the same way in
    both executors; None on an engine executor built without one (a server always
    has one), which a policy that prices steps must allow for. ``max_num_seqs`` and
    ``max_batch_tokens`` are the engine's limits on sequences per step and tokens per
    step; ``num_decoding`` is how many
    RUNNING sequences have finished prefill and will decode in the next step.

    With automatic prefix caching, admitting a waiting sequence may find the
    KV of its prompt's beginning cached: :meth:`prefix_hit` says how much, so
    a policy charges the step's token budget only for what the prefill will
    compute (KV memory is still the whole prompt's: a hit is a copy).
    """

    now: float
    waiting: Sequence[Seq]
    running: Collection[Seq]
    prefilling: Collection[Seq]
    suspended: Collection[Seq]
    kv_capacity: int
    kv_free: int
    max_num_seqs: int
    max_batch_tokens: int
    num_decoding: int = 0
    cost: CostModel | None = None
    prefix_lookup: Callable[[Seq], int] | None = None

    def prefix_hit(self, seq: Seq) -> int:
        """Prompt tokens whose KV the prefix cache supplies if waiting ``seq`` is
        admitted at this scheduling point (exactly what the executor then finds);
        0 without a prefix cache and for a sequence that is not waiting.

        Its prefill then computes ``seq.prefill_target - prefix_hit(seq)`` tokens.
        """
        lookup = self.prefix_lookup
        return 0 if lookup is None else lookup(seq)
