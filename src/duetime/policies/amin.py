"""Amin: start from the predicted lower bounds and learn from cancellations.

Chen, Ye, Zhou (2025), Algorithms 2 and 5. Each request carries a lower bound
``õ_i`` on its output length, first the prediction's lower end ``ℓ_i``.

- Batches: waiting requests in ascending ``õ_i`` (ties broken at random) are
  admitted while the Eq. 3 check holds with every length taken as its lower
  bound (a running request that already passed ``õ_i`` is assumed to finish
  with its next token).
- Overflow: when the next step does not fit in memory, running requests are
  cancelled in ascending ``õ_i`` (random ties) until it does. A cancelled
  request restarts from scratch and its bound rises to the tokens it had
  generated, ``õ_i ← max(õ_i, a_i)``, so it queues behind the shorter ones.

It never reads the upper bound. Competitive ratio ``O(log α⁻¹)``
(Theorem 5), at most ``(3 − α)/2`` under two-point lengths (Theorem 6).
"""

from __future__ import annotations

from typing import Any

from duetime.core.sequence import Seq
from duetime.policies.future_memory import tiebreak
from duetime.policies.lookahead import LookaheadPolicy, lower_bound
from duetime.policies.registry import register


@register("amin")
class Amin(LookaheadPolicy):
    """Lower bounds first; on overflow cancel the smallest bound and raise it to what it made."""

    name = "amin"
    default_predictor: str | None = "interval:rough"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._bound: dict[int, int] = {}  # õ_i, from the prediction until a cancellation raises it

    def bound(self, seq: Seq) -> int:
        """The current lower bound õ_i."""
        b = self._bound.get(seq.rid)
        if b is None:
            b = self._bound[seq.rid] = lower_bound(seq)
        return b

    def assumed_len(self, seq: Seq) -> int:
        return max(self.bound(seq), seq.generated + 1)

    def forget(self, rid: int) -> None:
        self._bound.pop(rid, None)

    def waiting_key(self, seq: Seq) -> Any:
        return (self.bound(seq), tiebreak(self.seed, seq.rid, seq.num_preemptions))

    def victim_key(self, seq: Seq, now: float) -> Any:
        # Ascending õ is cancelled first: the largest key is the smallest bound. The
        # bound of a running request is at least what it has made (Sec. 4: "once a
        # request has generated ℓ̃ tokens, õ = ℓ̃"; the proof of Theorem 4 reads a
        # larger õ as "processed for longer"), so the least-invested one goes first.
        live = max(self.bound(seq), seq.generated)
        return (-live, tiebreak(self.seed, seq.rid, seq.num_preemptions, 1))

    def on_cancel(self, seq: Seq) -> None:
        self._bound[seq.rid] = max(self.bound(seq), seq.generated)
