"""TimeBill's closed forms (Fan et al., arXiv 2512.21859, Sec. 4.1, 4.2 and 5.1), as pure functions.

Notation of the paper:

* ``N̂ = min(N_max, n̂·B)`` — the predicted response length (Eq. 2);
* ``N̂_W = min(k·N̂, N_max)`` — the pessimistic (WCET) length, ``k = 5`` by default;
* ETE: prefill ``t̂_prefill(N_x) = a·N_x² + b·N_x + c`` (Eq. 4a), decode step
  ``t̂_i = p·N_kv^i + q`` (Eq. 4b), with ``N_kv^i = (1 − α)·N_x + i − 1`` after an
  eviction of ratio α right after prefill (Eq. 5–6);
* ``t̂_WCET = t̂_prefill + Σ_{i=1}^{N̂_W − 1} t̂_i`` (Eq. 7–9);
* α* = the smallest α in ``[0, α_max]`` with ``t_Predict + t̂_WCET <= T`` (Eq. 10).

Solving Eq. 10 with the decode sum written out,
``Σ t̂_i = (N̂_W − 1)·(q + p·(1 − α)·N_x) + g·(N̂_W − 1)(N̂_W − 2)/2`` with the
per-step growth ``g = p`` of the paper, gives::

    α* = min(α_max, max(0, 1 − R / (p·N_x·(N̂_W − 1)) + q / (p·N_x) + g·(N̂_W − 2) / (2·p·N_x)))

with ``R = T − t̂_prefill − t_Predict``. For ``g = p`` the last term is
``(N̂_W − 2) / (2·N_x)``; the paper's Eq. 11 prints it as ``(N̂_W − 2) / (2·p·N_x)``, which is
not dimensionally consistent (a typo: the brute-force test in
``tests/test_timebill_math.py`` checks our form against a search over α on the same
estimator). ``g`` is a parameter so that a batched step, where every other decoder
also grows its KV by one token per step, can be accounted for (``g = p·D``).
"""

from __future__ import annotations

import math

from duetime.core.cost import LinearStepCost
from duetime.predict.ete import TimeBillETE

ALPHA_MAX = 0.95  # the paper's α_max
PESSIMISTIC_K = 5.0  # the paper's default pessimistic factor k


def predicted_length(point: float, n_max: int, bucket: int = 1) -> int:
    """Eq. 2 post-processing: ``N̂ = min(N_max, ⌈point / B⌉·B)``; ``B = 1`` for a point predictor."""
    n_hat = math.ceil(max(point, 1.0) / bucket) * bucket
    return int(min(n_max, n_hat))


def wcet_length(n_hat: float, n_max: int, k: float = PESSIMISTIC_K) -> int:
    """``N̂_W = min(k·N̂, N_max)``, rounded up to whole tokens."""
    if k < 1:
        raise ValueError(f"pessimistic factor k must be >= 1, got {k}")
    return int(min(n_max, math.ceil(k * n_hat)))


def ete_from_cost(cost: LinearStepCost) -> TimeBillETE:
    """TimeBill's single-request ETE implied by a :class:`LinearStepCost`.

    A whole prompt alone costs ``c0 + c_prefill + a1·N + a2·N²`` and a decode step of one
    sequence ``c0 + b + d·N_kv``, so ``a = a2, b = a1, c = c0 + c_prefill, p = d, q = c0 + b``
    (the inverse of :meth:`LinearStepCost.timebill` when ``c ≥ q``; otherwise ``c`` comes back
    as ``q``: ``timebill()`` stores ``c_prefill = max(c − q, 0)``, so the round trip gives
    ``max(c, q)``). With row bands (:mod:`duetime.core.cost_bands`) a prompt's cost is
    linear plus ``a2·N²`` only within a band, so ``b`` and ``c`` are read off the band long
    prompts fall in (two points, both past the last edge); ``q`` is one sequence's step.
    """
    if not cost.bands:
        return TimeBillETE(
            a=cost.a2, b=cost.a1, c=cost.c0 + cost.c_prefill, p=cost.d, q=cost.c0 + cost.b
        )
    n1 = 1 + max((int(b.lo) for b in cost.bands), default=0) + 1
    n2 = 2 * n1
    lin1 = cost.prefill_time(n1) - cost.a2 * cost.chunk_attention(n1, n1)
    lin2 = cost.prefill_time(n2) - cost.a2 * cost.chunk_attention(n2, n2)
    slope = (lin2 - lin1) / (n2 - n1)
    return TimeBillETE(a=cost.a2, b=slope, c=lin1 - slope * n1, p=cost.d, q=cost.decode_step(1, 0))


def decode_phase_time(
    n_x: int, n_w: int, alpha: float, p: float, q: float, growth: float | None = None
) -> float:
    """Eq. 7: ``Σ_{i=1}^{N_W − 1} (q + p·(1 − α)·N_x + g·(i − 1))`` with ``g = p`` by default."""
    g = p if growth is None else growth
    steps = max(n_w - 1, 0)
    return steps * (q + p * (1.0 - alpha) * n_x) + g * steps * (steps - 1) / 2.0


def optimal_eviction_ratio(
    budget_s: float,
    t_prefill_s: float,
    n_x: int,
    n_w: int,
    p: float,
    q: float,
    *,
    t_predict_s: float = 0.0,
    alpha_max: float = ALPHA_MAX,
    growth: float | None = None,
) -> float:
    """The paper's α* (Eq. 11, with the typo fixed; see the module docstring).

    ``budget_s`` is T, ``t_prefill_s`` the (estimated or measured) prefill time, ``n_x`` the
    prompt's KV tokens, ``n_w`` the WCET length ``N̂_W`` in tokens, ``p``/``q`` the decode
    coefficients, ``growth`` the per-step increase of the step time (``p`` alone; ``p·D`` for a
    batch of D). Returns 0 when the budget is ample, ``alpha_max`` when even that misses it,
    and 0 when eviction cannot change the time (no decode step, ``p·N_x = 0``).
    """
    if not 0.0 <= alpha_max < 1.0:
        raise ValueError(f"alpha_max must be in [0, 1), got {alpha_max}")
    steps = n_w - 1
    pn = p * n_x
    if steps <= 0 or pn <= 0:
        return 0.0
    g = p if growth is None else growth
    rest = budget_s - t_prefill_s - t_predict_s
    alpha = 1.0 - rest / (pn * steps) + q / pn + g * (steps - 1) / (2.0 * pn)
    return float(min(alpha_max, max(0.0, alpha)))
