"""Step times learned online from the engine's own steps, for admission control.

A fitted profile (`duetime profile`) is measured once, often on a quieter
machine than the one serving; the server instead keeps fitting the same
step-cost model `duetime profile` fits (:func:`duetime.predict.ete.fit_batch_cost`:
the linear terms plus a band per kernel regime the engine reports, minimising
the mean absolute relative error) over its most recent steps. Until enough
steps are seen, a given profile (or the steps timed at start, or nothing:
admission then accepts everything it cannot judge) stands in.
"""

from __future__ import annotations

import threading
from collections import deque

from duetime.core.cost import CostModelError, LinearStepCost
from duetime.core.cost_bands import CostRegimes
from duetime.predict.ete import StepSample, fit_batch_cost, step_kind

__all__ = ["StepTimer"]


class StepTimer:
    """Ring buffer of the engine's recent steps and the cost model fitted to them.

    ``refit_every``: steps between fits. A fit over 256 steps takes ~12 ms here (a
    linear programme), run on the engine thread: every 32 steps that is well under
    1 ms a step.
    """

    def __init__(
        self,
        prior: LinearStepCost | None = None,
        *,
        prior_source: str = "given",
        regimes: CostRegimes | None = None,
        window: int = 256,
        min_steps: int = 16,
        refit_every: int = 32,
    ) -> None:
        self._rows: deque[StepSample] = deque(maxlen=window)
        self._regimes = regimes
        self._min_steps = min_steps
        self._refit_every = refit_every
        self._since_fit = refit_every  # the first fit comes as soon as min_steps are in
        self._lock = threading.Lock()
        self._cost: LinearStepCost | None = prior
        self._prior_source = prior_source
        self._fitted_on = 0  # steps the current model was fitted to (0: the prior)

    @property
    def ready(self) -> bool:
        """Whether there is any model to predict with."""
        return self._cost is not None

    @property
    def steps_seen(self) -> int:
        return len(self._rows)

    @property
    def regimes(self) -> CostRegimes | None:
        return self._regimes

    def observe(
        self, seconds: float, prefill: int, decoders: int, kv: int, attn: float = 0.0
    ) -> bool:
        """Record one executed step (called on the engine thread). True if it refitted."""
        if seconds <= 0 or (prefill == 0 and decoders == 0):
            return False  # nothing a step-cost model describes
        self._rows.append(
            StepSample(prefill, float(attn), decoders, kv, seconds, step_kind(prefill, decoders))
        )
        self._since_fit += 1
        if len(self._rows) >= self._min_steps and self._since_fit >= self._refit_every:
            self._refit()
            return True
        return False

    def _refit(self) -> None:
        try:
            cost = fit_batch_cost(list(self._rows), name="online", regimes=self._regimes)
        except (ValueError, CostModelError):
            return  # keep the last model: one odd window must not take admission down
        with self._lock:
            self._cost = cost
            self._fitted_on = len(self._rows)
        self._since_fit = 0

    def step_time(self, prefill: int, decoders: int, kv: int) -> float:
        """Seconds for a step of ``prefill`` prompt tokens (one chunk from position 0)
        beside ``decoders`` sequences attending ``kv`` tokens (0 with no model)."""
        with self._lock:
            cost = self._cost
        if cost is None:
            return 0.0
        return cost.step_time(prefill, float(prefill) * prefill, decoders, kv)

    def prefill_time(self, n: int) -> float:
        """Seconds to prefill ``n`` tokens alone (0 with no model)."""
        return self.step_time(n, 0, 0) if n > 0 else 0.0

    def as_cost(self) -> LinearStepCost | None:
        """The current fit as the simulator's cost model (what policies read)."""
        with self._lock:
            return self._cost

    def origin(self) -> tuple[str | None, int]:
        """Where the current model came from, and the steps it was fitted to: the prior's
        source (say ``"given profile"`` or ``"measured at start"``) and 0, or
        ``"online fit"`` and the window's steps at the last fit; None with no model.
        What ``GET /v1/profile`` tells a gateway about how far to trust the model."""
        with self._lock:
            if self._cost is None:
                return None, 0
            if self._fitted_on:
                return "online fit", self._fitted_on
            return self._prior_source, 0

    def coefficients(self) -> dict[str, object] | None:
        with self._lock:
            cost = self._cost
        if cost is None:
            return None
        return {
            "c_s": cost.c0,
            "per_prefill_token_s": cost.a1,
            "per_decoder_s": cost.b,
            "per_kv_token_s": cost.d,
            "bands": [b.as_dict() for b in cost.bands],
        }
