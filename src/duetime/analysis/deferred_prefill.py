"""Throughput of deferred prefill: Theorem 1, Proposition 1 and K* (Mohanty et al., EuroMLSys 2025).

The model: the batch holds ``C`` requests; the queue never empties; each
request in the batch leaves after each decode step with probability ``α``
(geometric decode lengths, mean ``1/α`` steps); a decode step with ``X``
requests takes ``c_d + t_d·X``; once ``K`` or more have left since the last
prefill phase, one prefill phase refills it, taking ``c_p + (t_p·d₀/N)·m``
for ``m`` prompts. With ``N₁`` the decode steps of a cycle and ``X_S`` the
requests left when it ends, renewal-reward gives (Theorem 1)

    ρ(K) = (C − E X_S) / E T₁
         = ( (c_p + c_d·E N₁) / (C − E X_S) + t_d/α + t_p·d₀/N )⁻¹    [requests/s].

``E N₁`` and ``E X_S`` come from the absorbing Markov chain
``X_j ~ Binomial(X_{j−1}, 1 − α)`` started at ``C`` and stopped at
``X <= C − K`` (:func:`cycle_moments`, exact). Proposition 1 approximates
``X_S ≈ C − K`` and ``E N₁ ≈ ln(1 − K/C) / ln(1 − α)``:

    ρ(K)⁻¹ ≈ (1/K)·(c_p + c_d·ln(1 − K/C)/ln(1 − α)) + t_d/α + t_p·d₀/N,

convex in ``K``, so it has one maximiser ``K*``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost


@lru_cache(maxsize=8)
def _survivors_pmf(capacity: int, alpha: float) -> np.ndarray:
    """``p[x, y] = P(y of x requests stay for another step)``, Binomial(x, 1 − α)."""
    from scipy.stats import binom

    xs = np.arange(capacity + 1)
    p = binom.pmf(xs[None, :], xs[:, None], 1 - alpha)
    p.setflags(write=False)
    return p


def cycle_moments(capacity: int, alpha: float, k: int) -> tuple[float, float]:
    """``(E N₁, E X_S)``: decode steps per cycle and requests left when it ends.

    Exact: solves the chain on the transient states ``C − K < x <= C`` from the
    bottom up (a step can only lower ``x``), with the binomial probabilities
    of every transition.
    """
    c = capacity
    if not 1 <= k <= c:
        raise ValueError(f"need 1 <= K <= C, got K={k}, C={c}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    p = _survivors_pmf(c, float(alpha))
    floor = c - k  # absorbing states are 0..floor
    f = np.zeros(c + 1)  # E steps to absorption from x
    g = np.zeros(c + 1)  # E absorbed state from x
    g[: floor + 1] = np.arange(floor + 1)
    for x in range(floor + 1, c + 1):
        row = p[x]
        mid = slice(floor + 1, x)
        leave = 1.0 - row[x]
        f[x] = (1.0 + row[mid] @ f[mid]) / leave
        g[x] = (row[: floor + 1] @ g[: floor + 1] + row[mid] @ g[mid]) / leave
    return float(f[c]), float(g[c])


#: Longest mean output ``from_cost`` takes, in tokens: past any model's context, and
#: far from where ``1 - alpha`` rounds to 1 (1e18 gave a NaN throughput, exit 0).
MAX_MEAN_OUTPUT = 1e7
#: Shortest mean output, in tokens: the prefill's token and at least one decode step.
MIN_MEAN_OUTPUT = 2.0


def departure_alpha(mean_output: float) -> float:
    """α, the per-step departure probability of outputs of mean ``mean_output`` tokens.

    The first token is the prefill's, so ``1/α = mean_output − 1`` decode steps.
    A request in the batch decodes at least once (α is a probability, so
    ``1/α >= 1``): a mean under 2 tokens fits no α and is refused rather than
    clamped to α = 1, which would model ``--mean-output 1.2`` as 2 tokens unsaid.
    """
    if not mean_output >= MIN_MEAN_OUTPUT:  # NaN too
        raise ValueError(
            f"mean output (--mean-output) must be >= {MIN_MEAN_OUTPUT:g} tokens (the "
            f"prefill's and at least one decode step's), got {mean_output:g}"
        )
    return 1.0 / (mean_output - 1.0)


@dataclass(frozen=True, slots=True)
class DeferredPrefillModel:
    """The paper's parameters; times in seconds.

    ``prefill_per_prompt`` is ``t_p·d₀/N`` (the prefill time one prompt adds to a
    phase); ``c_p`` the fixed cost of a prefill phase; ``c_d + t_d·X`` a decode
    step of ``X`` requests; ``alpha`` the per-step departure probability
    (``1/α`` = mean decode steps per request).
    """

    capacity: int
    alpha: float
    c_p: float
    prefill_per_prompt: float
    c_d: float
    t_d: float

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        for name in ("c_p", "prefill_per_prompt", "c_d", "t_d"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")

    @classmethod
    def from_cost(
        cls, cost: LinearStepCost, capacity: int, mean_output: float, prompt_len: float
    ) -> DeferredPrefillModel:
        """Read the parameters off a step-cost profile.

        ``mean_output`` counts every output token, the first (made by the
        prefill) included, so ``1/α = mean_output − 1`` decode steps. A prefill
        phase costs ``c0 + c_prefill`` plus ``a1·d₀ + a2·d₀²`` per prompt; a decode
        step ``c0 + b·X + d·KV``, and a request attends to ``d₀ + (1 − α)/α`` KV
        tokens averaged over its decode steps, so ``t_d = b + d·(d₀ + (1 − α)/α)``
        makes the per-request decode work ``t_d/α`` exact.
        """
        if not MIN_MEAN_OUTPUT <= mean_output <= MAX_MEAN_OUTPUT:  # 1e18: 1 - α == 1, ρ NaN
            raise ValueError(
                f"mean output (--mean-output) must be >= {MIN_MEAN_OUTPUT:g} and "
                f"<= {MAX_MEAN_OUTPUT:.0e} tokens, got {mean_output!r}"
            )
        if not 0 < prompt_len <= MAX_MEAN_OUTPUT:  # NaN too; 1e30 printed a 55-digit step
            raise ValueError(
                f"prompt length (--prompt-len) must be > 0 and <= {MAX_MEAN_OUTPUT:.0e} tokens, "
                f"got {prompt_len:g}"
            )
        alpha = departure_alpha(mean_output)
        d0 = float(prompt_len)
        return cls(
            capacity=capacity,
            alpha=alpha,
            c_p=cost.c0 + cost.c_prefill,
            # the prompt's own work (its rows' bands included) over a step's fixed part
            prefill_per_prompt=cost.prompt_step(d0) - cost.c0 - cost.c_prefill,
            c_d=cost.c0,
            # a decoder's share of a full batch's step (b with no bands)
            t_d=(cost.decode_step(capacity, 0) - cost.c0) / capacity
            + cost.d * (d0 + (1 - alpha) / alpha),
        )

    def to_cost(self, prompt_len: int) -> LinearStepCost:
        """The step-cost model the simulator needs to play this model exactly (needs c_p >= c_d)."""
        if self.c_p < self.c_d:
            raise ValueError(f"c_p={self.c_p} < c_d={self.c_d}: not a linear step cost")
        return LinearStepCost(
            c0=self.c_d,
            c_prefill=self.c_p - self.c_d,
            a1=self.prefill_per_prompt / prompt_len,
            b=self.t_d,
            name="deferred-prefill-model",
        )

    # --- Theorem 1 ----------------------------------------------------------------
    def _per_request(self) -> float:
        return self.t_d / self.alpha + self.prefill_per_prompt

    def throughput(self, k: int) -> float:
        """Exact ρ(K) of Theorem 1, requests per second."""
        en, ex = cycle_moments(self.capacity, self.alpha, k)
        return 1.0 / ((self.c_p + self.c_d * en) / (self.capacity - ex) + self._per_request())

    def throughput_approx(self, k: float) -> float:
        """Proposition 1's approximation (defined for ``K < C``).

        At α = 1 it takes ``N₁ = 1``, not the formula's 0 (``ln(1 − α) = −∞``): every
        request leaves after its one decode step, so a cycle is exactly one step.
        """
        c = self.capacity
        if not 0 < k < c:
            return 0.0
        n1 = math.log(1 - k / c) / math.log1p(-self.alpha) if self.alpha < 1 else 1.0
        return 1.0 / ((self.c_p + self.c_d * n1) / k + self._per_request())

    def optimal_k(self) -> int:
        """K* maximising the exact ρ(K) over 1..C."""
        ks = range(1, self.capacity + 1)
        return max(ks, key=self.throughput)

    def optimal_k_approx(self) -> int:
        """K* of the approximation: its unique maximiser, rounded to the better integer."""
        c = self.capacity
        if c < 2:
            return 1
        ks = np.arange(1, c)
        # N₁ = 1 at α = 1, as in throughput_approx.
        n1 = np.log1p(-ks / c) / math.log1p(-self.alpha) if self.alpha < 1 else np.ones(len(ks))
        inv = (self.c_p + self.c_d * n1) / ks + self._per_request()
        return int(ks[int(np.argmin(inv))])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def advise(model: DeferredPrefillModel) -> dict[str, Any]:
    """K*, ρ(K*) and the gain over K = 1; keys carry units.

    Two gains for Proposition 1's ``K*`` (``k_star_approx``), which differ: the
    exact one of Theorem 1 at that K (``theorem1_gain_at_k_star_approx_pct``,
    what running that K gives in the model) and the one Proposition 1 itself
    predicts (``prop1_gain_pct``, its ρ̃(K*) over its ρ̃(1)). Proposition 1 takes
    ``X_S = C − K``, a cycle serving exactly K; at K = 1 that undercounts (several
    can leave in a cycle's last step), so ρ̃(1) is low and its gain high (C = 256,
    mean output 320: +9.18 % predicted, +6.05 % by Theorem 1).
    """
    k_star = model.optimal_k()
    rho1 = model.throughput(1)
    rho_star = model.throughput(k_star)
    adv: dict[str, Any] = {
        **{MODEL_KEYS[k]: v for k, v in model.to_dict().items()},
        "k_star": k_star,
        "throughput_k_star_req_s": rho_star,
        "throughput_k1_req_s": rho1,
        "gain_vs_k1_pct": 100.0 * (rho_star / rho1 - 1.0),
    }
    if model.capacity < 2:  # Proposition 1 needs a K < C: with C = 1 there is none
        return adv | dict.fromkeys(PROP1_KEYS)
    k_approx = model.optimal_k_approx()
    rho_at_approx = model.throughput(k_approx)
    prop1_star = model.throughput_approx(k_approx)
    prop1_k1 = model.throughput_approx(1)
    return adv | {
        "k_star_approx": k_approx,
        "theorem1_throughput_at_k_star_approx_req_s": rho_at_approx,
        "theorem1_gain_at_k_star_approx_pct": 100.0 * (rho_at_approx / rho1 - 1.0),
        "prop1_throughput_k_star_approx_req_s": prop1_star,
        "prop1_throughput_k1_req_s": prop1_k1,
        "prop1_gain_pct": 100.0 * (prop1_star / prop1_k1 - 1.0) if prop1_k1 else math.nan,
    }


#: The model's parameters in :func:`advise`'s figures, named with their units.
MODEL_KEYS = {
    "capacity": "model_capacity",
    "alpha": "model_alpha",
    "c_p": "model_c_p_s",
    "prefill_per_prompt": "model_prefill_per_prompt_s",
    "c_d": "model_c_d_s",
    "t_d": "model_t_d_s",
}
#: :func:`advise`'s figures of Proposition 1 (null where it is undefined, C = 1).
PROP1_KEYS = (
    "k_star_approx",
    "theorem1_throughput_at_k_star_approx_req_s",
    "theorem1_gain_at_k_star_approx_pct",
    "prop1_throughput_k_star_approx_req_s",
    "prop1_throughput_k1_req_s",
    "prop1_gain_pct",
)
