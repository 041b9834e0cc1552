"""Amax: schedule every request as if its output were its predicted upper bound.

Chen, Ye, Zhou (2025), Algorithm 1. With all lengths taken as ``u`` the Eq. 3
check can never be violated by the truth (``o_i <= u``), so Amax never cancels;
the price is memory held for tokens that never come. With one interval for
all requests every job looks alike and the batch is a random sample of the
waiting ones (seeded tie-break); with per-request intervals (binned or
individual predictions) we order by upper bound, i.e. Amax is H-SF run on the
upper bounds. Competitive ratio between ``α⁻¹(1 + α⁻¹ᐟ²)/2`` and
``α⁻¹(1 + α⁻¹)/2`` (Theorems 1–2), ``α = ℓ/u``.

If a request outgrows its upper bound (a bad predictor), memory can run out;
then the most recently admitted requests restart, as in vLLM.
"""

from __future__ import annotations

from duetime.core.sequence import Seq
from duetime.policies.lookahead import LookaheadPolicy, upper_bound
from duetime.policies.registry import register


@register("amax")
class Amax(LookaheadPolicy):
    """H-SF on the predicted upper bounds."""

    name = "amax"
    default_predictor: str | None = "interval:rough"

    def assumed_len(self, seq: Seq) -> int:
        return max(upper_bound(seq), seq.generated + 1)
