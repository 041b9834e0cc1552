"""The plain-data answer a policy gives an executor for one scheduling point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PreemptMode = Literal["recompute", "swap", "restart"]


@dataclass(slots=True)
class Decision:
    """What to do at this scheduling point.

    Executors apply the lists in this order: cancel, preempt, suspend,
    resume, evict, prefill; then they run one step in which every RUNNING
    sequence whose prefill is done decodes one token, and every ``prefill``
    entry computes ``num_tokens`` prompt tokens (0 = all that remain; a smaller
    number is a chunked prefill).

    ``prefill`` may name a WAITING sequence (admission: it gets KV memory and
    becomes RUNNING) or a RUNNING sequence whose prefill is unfinished.
    ``preempt`` frees a RUNNING/SUSPENDED sequence's KV; with ``recompute`` it
    re-prefills prompt + generated tokens later, with ``swap`` its KV is copied
    out and back (costed by the executor), with ``restart`` its output is
    discarded and it starts over from the prompt (the "cancellation" of the
    Amin/Amax paper: generated = 0, the whole answer is produced again).
    ``suspend`` keeps KV but stops decoding; ``resume`` undoes it. ``evict``
    maps rid → ratio α ∈ [0, 1) of the sequence's current KV to drop
    (TimeBill). ``wake_at`` asks to be called again at that time even if
    nothing else happens (deadline timers); executors always call again on
    arrivals, completions, segment ends and memory pressure.

    ``prefill_only`` runs the step's prefill chunks alone: every decoder holds
    (no token this step; its KV, batch slot and place stay), as vLLM 0.6's
    default scheduler runs a prefill step (deferred prefill's stall). It costs
    the executor nothing per decoder, where suspending the batch and resuming
    it a step later costs two state changes per decoder. It needs a ``prefill``.
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    preempt: list[int] = field(default_factory=list)
    preempt_mode: PreemptMode = "recompute"
    suspend: list[int] = field(default_factory=list)
    resume: list[int] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    evict: dict[int, float] = field(default_factory=dict)
    wake_at: float | None = None
    prefill_only: bool = False

    def is_empty(self) -> bool:
        return not (
            self.prefill or self.preempt or self.suspend or self.resume or self.cancel or self.evict
        )
