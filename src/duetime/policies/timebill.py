"""TimeBill: time-budgeted inference by KV-cache eviction (Fan et al., arXiv 2512.21859).

Each request with a deadline has the time budget ``T = deadline − arrival``. Right after
its prefill completes the policy evicts, once, the fraction α* of its KV cache that the
paper's closed form (Eq. 11, :func:`~duetime.policies.timebill_math.optimal_eviction_ratio`)
says is the least that brings the worst-case finish inside the budget:

* ``N̂`` is ``Request.predicted.point`` capped at ``N_max = Request.max_tokens`` (Eq. 2);
  ``N̂_W = min(k·N̂, N_max)`` with ``k = 5`` (no prediction: ``N̂_W = N_max``);
* the remaining budget ``R`` is measured, not estimated: ``deadline − now`` at the end of
  the prefill (it already contains queueing and the real prefill time; for a lone request
  with an exact ETE it equals the paper's ``T − t̂_prefill``); ``t_Predict = 0`` because the
  paper runs the predictor in parallel with the prefill (Sec. 5.2);
* the ETE comes from ``snap.cost`` (:func:`~duetime.policies.timebill_math.ete_from_cost`:
  ``p = d``, ``q = c0 + b``). With ``batch_aware`` (default) a decode step is costed as the
  current batch's step: ``q = c0 + b·D + d·KV_others`` and the per-step growth ``g = d·D``
  (every other decoder keeps decoding for the whole horizon: an upper bound, in the spirit
  of a WCET). With D = 1 this is exactly the paper's single-request form.

``fixed_alpha`` turns the policy into the paper's baselines: ``0`` is Vanilla, ``0.25``…
``0.95`` the fixed-ratio KV eviction. The overrun strategy applies to all of them:

* ``"kill"``: a request whose deadline has passed is cancelled at the first step boundary
  at or after its deadline (the policy asks to be woken at the earliest deadline);
* ``"skip-next"``: requests with the same ``Request.klass`` form one task. A job is never
  killed; while an earlier job of its task is unfinished *and* past its deadline
  (overrunning), every job of the task that has not started yet is skipped (cancelled at
  the first scheduling point that sees it, i.e. at its release). With periodic jobs and
  implicit deadlines (deadline = next release) that is the paper's "skip the next jobs until
  the current one completes".

Queue order is EDF (deadline, then arrival) without head-of-line blocking; memory pressure
is handled by the generic loop of :class:`~duetime.policies.base.QueuePolicy`. A sequence
that is preempted by recompute and prefilled again is not evicted a second time.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from duetime.core.cost import LinearStepCost
from duetime.core.decision import Decision
from duetime.core.sequence import Seq
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy
from duetime.policies.edf import deadline_of
from duetime.policies.registry import register
from duetime.policies.timebill_math import (
    ALPHA_MAX,
    PESSIMISTIC_K,
    optimal_eviction_ratio,
    predicted_length,
    wcet_length,
)

Overrun = Literal["kill", "skip-next"]
OVERRUN_STRATEGIES: tuple[str, ...] = ("kill", "skip-next")


@register("timebill")
class TimeBill(QueuePolicy):
    """α* (or a fixed α) evicted after prefill; Kill or Skip-Next on overrun."""

    name = "timebill"
    default_predictor: str | None = "noisy"

    def __init__(
        self,
        *,
        fixed_alpha: float | None = None,
        overrun: Overrun = "kill",
        k: float = PESSIMISTIC_K,
        alpha_max: float = ALPHA_MAX,
        batch_aware: bool = True,
        t_predict_s: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if fixed_alpha is not None and not 0.0 <= fixed_alpha < 1.0:
            raise ValueError(f"fixed_alpha must be in [0, 1), got {fixed_alpha}")
        if overrun not in OVERRUN_STRATEGIES:
            raise ValueError(f"overrun must be one of {OVERRUN_STRATEGIES}, got {overrun!r}")
        if k < 1:
            raise ValueError(f"pessimistic factor k must be >= 1, got {k}")
        kwargs.setdefault("head_of_line_blocking", False)
        super().__init__(**kwargs)
        self.fixed_alpha = fixed_alpha
        self.overrun = overrun
        self.k = k
        self.alpha_max = alpha_max
        self.batch_aware = batch_aware
        self.t_predict_s = t_predict_s
        self._evicted: set[int] = set()  # rids whose one eviction decision is made
        self._skip: set[int] = set()  # cancels chosen before the generic loop runs

    def forget(self, rid: int) -> None:
        self._evicted.discard(rid)
        self._skip.discard(rid)

    def waiting_key(self, seq: Seq) -> Any:
        return (deadline_of(seq), seq.req.arrival)

    def victim_key(self, seq: Seq, now: float) -> Any:
        return (deadline_of(seq), seq.order)

    def admissible(self, seq: Seq, snap: EngineSnapshot) -> bool:
        return seq.rid not in self._skip

    def resume_candidates(self, snap: EngineSnapshot) -> list[Seq]:
        # A segmented request killed at its deadline while between segments must not be
        # resumed in the same decision (cancel + resume of one request is illegal).
        return [s for s in super().resume_candidates(snap) if s.rid not in self._skip]

    # --- the decision ----------------------------------------------------------
    def schedule(self, snap: EngineSnapshot) -> Decision:
        now = snap.now
        cancel = self._overruns(snap)
        self._skip = set(cancel)
        dec = super().schedule(snap)
        dec.cancel = cancel + [r for r in dec.cancel if r not in self._skip]
        if self._skip:
            dec.preempt = [r for r in dec.preempt if r not in self._skip]
            dec.prefill = [(r, n) for r, n in dec.prefill if r not in self._skip]
        gone = set(dec.cancel) | set(dec.preempt)
        for seq in snap.running:
            if seq.rid in self._evicted or not seq.prefill_done or seq.rid in gone:
                continue
            self._evicted.add(seq.rid)
            alpha = self.eviction_ratio(seq, snap)
            if alpha > 0.0 and seq.kv_tokens > 0:
                dec.evict[seq.rid] = alpha
        groups = (snap.running, snap.suspended, snap.waiting)
        if any(self._overrun_of(s) == "kill" for g in groups for s in g):
            nxt = min(
                (
                    deadline_of(s)
                    for group in (snap.running, snap.suspended, snap.waiting)
                    for s in group
                    if deadline_of(s) > now and s.rid not in gone
                ),
                default=math.inf,
            )
            if nxt < math.inf:
                dec.wake_at = nxt
        return dec

    def _overruns(self, snap: EngineSnapshot) -> list[int]:
        now = snap.now
        live = [s for g in (snap.running, snap.suspended, snap.waiting) for s in g]
        killed = [s.rid for s in live if deadline_of(s) <= now and self._overrun_of(s) == "kill"]
        overrunning: dict[str, int] = {}  # task → order of its oldest overrunning job
        for s in live:
            if deadline_of(s) <= now and self._overrun_of(s) == "skip-next":
                k = s.req.klass
                overrunning[k] = min(overrunning.get(k, s.order), s.order)
        if not overrunning:
            return killed
        # A job killed on its own deadline (its request said "kill") may also be a job to
        # skip: cancelling it twice is an illegal decision that fails the whole step.
        dead = set(killed)
        return killed + [
            s.rid
            for s in snap.waiting
            if s.rid not in dead
            and s.prefilled == 0
            and s.generated == 0
            and s.req.klass in overrunning
            and s.order > overrunning[s.req.klass]
        ]

    def _overrun_of(self, seq: Seq) -> str:
        own = seq.req.overrun
        return own if own in OVERRUN_STRATEGIES else self.overrun

    # --- α ------------------------------------------------------------------------
    def eviction_ratio(self, seq: Seq, snap: EngineSnapshot) -> float:
        """α for a sequence whose prefill just finished: fixed, or the paper's α*.

        A request's own ``kv_eviction`` ("off", "auto" or a ratio) overrides the policy's;
        a ratio the client or the policy fixed is passed on as given.
        """
        own = seq.req.kv_eviction
        if own == "off":
            return 0.0
        if isinstance(own, float | int):
            return float(own)
        if self.fixed_alpha is not None and own != "auto":
            return self.fixed_alpha
        alpha, kv = self.optimal_ratio(seq, snap), seq.kv_tokens
        if alpha <= 0.0 or kv <= 0:
            return alpha
        # Executors evict ⌊α·KV⌋ tokens: ask for ⌈α*·KV⌉ so the estimate holds.
        n = math.ceil(alpha * kv - 1e-9)
        return min((n + 0.5) / kv, max(alpha, self.alpha_max))

    def optimal_ratio(self, seq: Seq, snap: EngineSnapshot) -> float:
        """The paper's α* for ``seq`` under its deadline, net of the eviction's own time."""
        cost = snap.cost
        deadline = seq.req.deadline
        if deadline is None or not isinstance(cost, LinearStepCost):
            return 0.0  # no budget, or no estimator: nothing to trade quality for
        n_max = seq.req.max_tokens
        pred = seq.req.predicted
        n_hat = n_max if pred is None else predicted_length(pred.point, n_max)
        # Tokens still to generate, as a WCET length counted from this point (Eq. 7 runs
        # N̂_W − 1 decode steps after the prefill's first token).
        n_w = wcet_length(n_hat, n_max, self.k) - seq.generated + 1
        p, q, growth = cost.d, cost.decode_step(1, 0), cost.d
        if self.batch_aware:
            d = max(snap.num_decoding, 1)
            kv_others = sum(s.kv_tokens for s in snap.running if s.decoding and s is not seq)
            q = cost.decode_step(d, kv_others)
            growth = cost.d * d

        def alpha_for(budget_s: float) -> float:
            return optimal_eviction_ratio(
                budget_s,
                0.0,  # the prefill is over: the measured remaining budget already excludes it
                seq.kv_tokens,
                n_w,
                p,
                q,
                t_predict_s=self.t_predict_s,
                alpha_max=self.alpha_max,
                growth=growth,
            )

        alpha = alpha_for(deadline - snap.now)  # the paper's α*
        evict_s = cost.eviction_time(seq.kv_tokens)
        if alpha <= 0.0 or evict_s <= 0.0:
            return alpha
        # Eviction takes time of its own (cost.e; zero in the paper's model): it comes
        # out of the budget, and evicting must save more decode time than it costs,
        # else the full KV finishes sooner (measured on the CPU engine: docs/timebill-engine.md).
        alpha = alpha_for(deadline - snap.now - evict_s)
        saved = p * alpha * seq.kv_tokens * max(n_w - 1, 0)
        return alpha if saved > evict_s else 0.0
