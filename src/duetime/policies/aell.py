"""A_ℓ ("promote-ℓ"): for two-point output lengths o ∈ {ℓ, u}.

Chen, Ye, Zhou (2025), Section 5.1 and Algorithm 6. Requests are served from
a FIFO queue, each assumed to be short (``ℓ``). A request that has produced
``ℓ`` tokens without finishing must be long: it is cancelled, its assumed
length becomes ``u``, and it goes to the back of the queue, so every long job
waits for the short ones. Behind them it may start again in the same step:
Alg. 6 moves it "to the end of R_t" and then fills the batch from ``R_t``.
Admission uses the Eq. 3 check with the assumed lengths, which are exact
under the two-point model, so memory never overflows there. Competitive
ratio at most ``1 + α/(2(1 − α))`` for ``α <= 1/2`` and ``1 + 2α²`` above
(Theorem 7); it beats Amin's ``(3 − α)/2`` when ``α < (3 − √5)/2 ≈ 0.382``.

``ℓ`` and ``u`` are each request's predicted lower and upper ends (one
interval for all requests in the paper's setting).
"""

from __future__ import annotations

from typing import Any

from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.lookahead import LookaheadPolicy, lower_bound, upper_bound
from duetime.policies.registry import register


@register("aell")
class PromoteEll(LookaheadPolicy):
    """FIFO; a request still running after ℓ tokens restarts at the back, assumed long."""

    name = "aell"
    default_predictor: str | None = "interval:rough"

    sorted_by_length = False
    readmit_restarted = True  # a promoted request is offered again at once, at the back

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("head_of_line_blocking", True)  # "starting from the front of R_t"
        super().__init__(**kwargs)
        self._long: set[int] = set()
        self._tickets = 0  # issued: a plain count, so that a fork carries it on

    def fresh_len(self, seq: Seq) -> int:
        """``u`` once promoted, else ``ℓ``: the length assumed before a token is made."""
        return upper_bound(seq) if seq.rid in self._long else lower_bound(seq)

    def assumed_len(self, seq: Seq) -> int:
        return max(self.fresh_len(seq), seq.generated + 1)

    def forget(self, rid: int) -> None:
        self._long.discard(rid)

    def waiting_key(self, seq: Seq) -> Any:
        self._tickets += 1  # arrival order; a promoted request joins the back
        return self._tickets

    def give_up(self, snap: EngineSnapshot) -> list[Seq]:
        return [
            s
            for s in snap.running
            if s.rid not in self._long and s.prefill_done and s.generated >= lower_bound(s)
        ]

    def on_cancel(self, seq: Seq) -> None:
        if seq.generated >= lower_bound(seq):  # not for an overflow victim (truth > u)
            self._long.add(seq.rid)

    def next_wake(self, snap: EngineSnapshot) -> int | None:
        steps = [
            lower_bound(s) - s.generated
            for s in snap.running
            if s.rid not in self._long and s.prefill_done
        ]
        return min((k for k in steps if k > 0), default=None)
