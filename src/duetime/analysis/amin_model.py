"""The exact model of Chen, Ye, Zhou (2025) on the simulator, and the paper's bounds.

The paper's model: one worker with a KV cache of ``M`` tokens; every job has
a prompt of ``s`` tokens and an output of ``o_i`` tokens; a batch takes one
time unit and gives each job in it one token; a job that has produced ``a_i``
tokens holds ``s + a_i`` tokens, and ``Σ (s + a_i) <= M`` after every batch
(constraint (1)); a job started at ``t`` finishes at ``t + o_i``; a cancelled
job starts over.

Mapped onto the simulator:

- time: :func:`unit_cost`, every step (prefill or decode, any batch) takes
  1 s, so a job admitted at ``t`` finishes at ``t + o_i`` (its prefill step
  produces the first token, as in the paper's first batch);
- memory: a job with ``a`` tokens after a step used ``prompt_len + a − 1``
  tokens in it (the newest token is fed back one step later, see
  ``core/sequence.py``), so ``prompt_len = s + 1`` makes the simulator's
  check exactly constraint (1) after every batch (:func:`paper_jobs`); a
  finished job frees its memory after its last batch. Eq. 3 as printed also
  charges, at the instant a job finishes, its ``s + o_i`` next to the ``s``
  of jobs starting then; we read it, like constraint (1), after each batch;
- no per-step caps (:func:`exact_config`); cancellation is
  ``preempt_mode="restart"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request
from duetime.sim.simulator import SimConfig

UNLIMITED = 1 << 40


def unit_cost() -> LinearStepCost:
    """Every step takes one time unit (1 s of simulated time)."""
    return LinearStepCost(c0=1.0, name="unit-step")


def exact_config(memory: int) -> SimConfig:
    """KV capacity ``M`` and no limits on sequences or tokens per step."""
    return SimConfig(kv_capacity=memory, max_num_seqs=UNLIMITED, max_batch_tokens=UNLIMITED)


def paper_jobs(outputs: Sequence[int], s: int = 0, arrival: float = 0.0) -> list[Job]:
    """Jobs with prompt size ``s`` (``prompt_len = s + 1``) and the given output lengths."""
    return [
        Job(Request(rid=i, arrival=arrival, prompt_len=s + 1, max_tokens=max(o, 1)), int(o))
        for i, o in enumerate(outputs)
    ]


def amax_ratio_bounds(alpha: float) -> tuple[float, float]:
    """Theorems 2 and 1 as printed: ``α⁻¹(1 + α⁻¹ᐟ²)/2 <= CR(Amax) <= α⁻¹(1 + α⁻¹)/2``."""
    return (1 + alpha**-0.5) / (2 * alpha), (1 + 1 / alpha) / (2 * alpha)


def theorem2_ratio(ell: int, u: int, a: int, b: int) -> float:
    """E[TEL(Amax)] / TEL(H-SF) on the instance of Theorem 2's proof, to first order.

    ``s = 0``, ``M = ℓu``, ``a·u`` jobs of length ``ℓ`` and ``b·ℓ`` of length
    ``u``: ``(u/ℓ)(au + bℓ)(a + b) / (ua² + 2abℓ + ub²)``. (The proof prints
    ``ℓ²ab`` for ``2abℓ`` in the denominator.)
    """
    return (u / ell) * (a * u + b * ell) * (a + b) / (u * a * a + 2 * a * b * ell + u * b * b)


def amin_two_point_bound(alpha: float) -> float:
    """Theorem 6: ``CR(Amin) <= (3 − α)/2`` when every length is ``ℓ`` or ``u``."""
    return (3 - alpha) / 2


def aell_bound(alpha: float) -> float:
    """Theorem 7: ``CR(A_ℓ) <= 1 + α/(2(1 − α))`` for ``α <= 1/2``, ``1 + 2α²`` above."""
    return 1 + alpha / (2 * (1 - alpha)) if alpha <= 0.5 else 1 + 2 * alpha * alpha


ALPHA_STAR = (3 - math.sqrt(5)) / 2  # below it A_ℓ's bound beats Amin's
