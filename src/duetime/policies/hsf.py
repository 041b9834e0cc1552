"""H-SF: hindsight shortest-first, the benchmark of Chen, Ye, Zhou (2025), Algorithm 3.

Knowing every output length ``o_i``, admit the shortest waiting jobs, in
order, while each keeps the memory constraint of Eq. 3 for its whole life
next to the running ones:

    Σ_{i∈S(t)} (s + t' − p_i)·1{o_i ≥ t' − p_i} + Σ_{i∈U} (s + t' − t)·1{o_i ≥ t' − t} ≤ M
    for all t' ≥ t.

It never needs a cancellation. Knowledge of ``o_i`` comes through the oracle
predictor (``Request.predicted.point``), as for ``sjf``: the policy itself
never reads the hidden truth. With another predictor it is "shortest
predicted first with the Eq. 3 check".
"""

from __future__ import annotations

from duetime.core.sequence import Seq
from duetime.policies.lookahead import LookaheadPolicy
from duetime.policies.registry import register


@register("hsf")
class HindsightShortestFirst(LookaheadPolicy):
    """Shortest (known) output first; admission checked against all future steps (Eq. 3)."""

    name = "hsf"
    default_predictor: str | None = "oracle"
    needs_prediction = True  # a server refuses to start it without a length predictor

    def assumed_len(self, seq: Seq) -> int:
        p = seq.req.predicted
        if p is None:
            raise ValueError("hsf needs a length prediction: run it with --predictor oracle")
        return max(round(p.point), seq.generated + 1)
