"""Step times learned online from the engine's own steps, for admission control.

A fitted profile (`duetime profile`) is measured once, often on a quieter
machine than the one serving; the server instead keeps fitting the batch cost
model ``t = c + a·P + b·D + d·KV`` (P prefill tokens, D decoding sequences,
KV tokens attended, the simulator's model) by non-negative least squares over
its most recent steps. Until enough steps are seen, a given profile (or
nothing: admission then accepts everything it cannot judge) stands in.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
from scipy.optimize import nnls

from duetime.core.cost import LinearStepCost

__all__ = ["StepTimer"]


class StepTimer:
    """Ring buffer of (seconds, prefill tokens, decoders, KV attended) and its NNLS fit."""

    def __init__(
        self,
        prior: LinearStepCost | None = None,
        *,
        window: int = 512,
        min_steps: int = 16,
        refit_every: int = 16,
    ) -> None:
        self._rows: deque[tuple[float, int, int, int]] = deque(maxlen=window)
        self._min_steps = min_steps
        self._refit_every = refit_every
        self._since_fit = 0
        self._lock = threading.Lock()
        self._coef: tuple[float, float, float, float] | None = None  # c, a (P), b (D), d (KV)
        if prior is not None:
            self._coef = (prior.c0, prior.a1, prior.b, prior.d)

    @property
    def ready(self) -> bool:
        """Whether there is any model to predict with."""
        return self._coef is not None

    @property
    def steps_seen(self) -> int:
        return len(self._rows)

    def observe(self, seconds: float, prefill: int, decoders: int, kv: int) -> bool:
        """Record one executed step (called on the engine thread). True if it refitted."""
        self._rows.append((seconds, prefill, decoders, kv))
        self._since_fit += 1
        if len(self._rows) >= self._min_steps and self._since_fit >= self._refit_every:
            self._refit()
            return True
        return False

    def _refit(self) -> None:
        data = np.asarray(self._rows, dtype=float)
        y = data[:, 0]
        x = np.column_stack([np.ones(len(y)), data[:, 1], data[:, 2], data[:, 3]])
        # Columns differ by 10^4 in scale; normalise so NNLS is well conditioned.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        coef, _ = nnls(x / scale, y)
        coef = coef / scale
        with self._lock:
            self._coef = (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))
        self._since_fit = 0

    def step_time(self, prefill: int, decoders: int, kv: int) -> float:
        with self._lock:
            if self._coef is None:
                return 0.0
            c, a, b, d = self._coef
        return c + a * prefill + b * decoders + d * kv

    def prefill_time(self, n: int) -> float:
        """Seconds to prefill ``n`` tokens alone (0 with no model)."""
        return self.step_time(n, 0, 0) if n > 0 else 0.0

    def as_cost(self) -> LinearStepCost | None:
        """The current fit as the simulator's batch cost model (what policies read)."""
        with self._lock:
            if self._coef is None:
                return None
            c, a, b, d = self._coef
        if c <= 0 and b <= 0:
            return None
        return LinearStepCost.batch(c=c, a=a, b=b, d=d)

    def coefficients(self) -> dict[str, float] | None:
        with self._lock:
            if self._coef is None:
                return None
            c, a, b, d = self._coef
        return {"c_s": c, "per_prefill_token_s": a, "per_decoder_s": b, "per_kv_token_s": d}
