"""Step times learned online from the engine's own steps, for admission control.

A fitted profile (`duetime profile`) is measured once, often on a quieter
machine than the one serving; the server instead keeps fitting the same
step-cost model `duetime profile` fits (:func:`duetime.predict.ete.fit_batch_cost`:
the linear terms plus a band per kernel regime the engine reports, minimising
the mean absolute relative error, then scaled so that it sums the window's steps
to their measured total: what it prices are sums of steps) over its most recent
steps, with the shapes they lack priced by the model known before
(:mod:`duetime.predict.step_anchors`). Until enough steps are seen, a given
profile (or the steps timed at start, or nothing: admission then accepts
everything it cannot judge) stands in.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from duetime.core.cost import CostModelError, LinearStepCost
from duetime.core.cost_bands import CostRegimes
from duetime.predict.ete import StepSample, fit_batch_cost, load_solver, step_kind
from duetime.predict.step_anchors import anchor_samples

__all__ = ["StepTimer"]


class StepTimer:
    """Ring buffer of the engine's recent steps and the cost model fitted to them.

    ``refit_every``: steps between fits, and ``min_interval_s``: seconds at least
    between the starts of two fits. A fit over 256 steps is a linear programme of
    12-46 ms here, and it holds the GIL. On the engine thread, every 32 steps, it took
    43 % of a no-op server's engine thread (steps of well under a millisecond) and
    delayed the requests that arrived meanwhile. ``background`` (the server's): fits
    run on a thread of their own, at most one at a time, and :meth:`observe` reports
    a new model once it is in. Without it (tests, offline use) a fit runs inside
    :meth:`observe`.
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
        min_interval_s: float = 0.0,
        background: bool = False,
    ) -> None:
        self._rows: deque[StepSample] = deque(maxlen=window)
        self._regimes = regimes
        self._min_steps = min_steps
        self._refit_every = refit_every
        self._min_interval_s = min_interval_s
        self._since_fit = refit_every  # the first fit comes as soon as min_steps are in
        self._last_fit_at = -float("inf")
        self._lock = threading.Lock()
        self._cost: LinearStepCost | None = prior
        self._prior = prior  # prices the shapes a window has not seen (predict.step_anchors)
        self._prior_source = prior_source
        self._fitted_on = 0  # steps the current model was fitted to (0: the prior)
        self._background = background
        self._fitter: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._pending: list[StepSample] | None = None  # the rows of the fit asked for
        self._fitting = False
        self._fresh = False  # a background fit is in that observe() has not reported
        self._closed = False
        if background:
            load_solver()  # at start: the first fit's import must not stall served requests

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
        """Record one executed step (called on the engine thread). True if a new model
        is in since the last call (fitted now, or by the background fitter)."""
        fresh = self._take_fresh()
        if seconds <= 0 or (prefill == 0 and decoders == 0):
            return fresh  # nothing a step-cost model describes
        self._rows.append(
            StepSample(prefill, float(attn), decoders, kv, seconds, step_kind(prefill, decoders))
        )
        self._since_fit += 1
        now = time.monotonic()
        if (
            len(self._rows) < self._min_steps
            or self._since_fit < self._refit_every
            or now - self._last_fit_at < self._min_interval_s
        ):
            return fresh
        if not self._background:
            if self._fit(list(self._rows)):
                self._since_fit, self._last_fit_at = 0, now
                return True
            return fresh
        with self._lock:
            if self._fitting or self._closed:
                return fresh
            self._pending, self._fitting = list(self._rows), True
            self._since_fit, self._last_fit_at = 0, now
            if self._fitter is None:
                self._fitter = threading.Thread(
                    target=self._fit_loop, name="duetime-step-fit", daemon=True
                )
                self._fitter.start()
            self._wake.notify_all()  # the fitter (and any wait_idle)
        return fresh

    def _take_fresh(self) -> bool:
        if not self._background:
            return False
        with self._lock:
            fresh, self._fresh = self._fresh, False
        return fresh

    def _fit(self, rows: list[StepSample]) -> bool:
        """Fit ``rows`` and put the model in; False (the last model kept) when the fit
        fails: one odd window must not take admission down."""
        anchors: list[StepSample] = []
        if self._prior is not None and self._regimes is not None:
            anchors = anchor_samples(self._prior, rows, self._regimes)
        try:
            cost = fit_batch_cost(
                rows, name="online", regimes=self._regimes, sum_calibrated=True, extra=anchors
            )
        except (ValueError, CostModelError):
            return False
        with self._lock:
            self._cost = cost
            self._fitted_on = len(rows)
            self._fresh = self._background
        return True

    def _fit_loop(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                rows, self._pending = self._pending, None
                if self._closed or rows is None:
                    self._fitting = False  # a fit asked for and dropped: none is running
                    self._wake.notify_all()
                    return
            try:
                self._fit(rows)
            finally:
                with self._lock:
                    self._fitting = False
                    self._wake.notify_all()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no background fit is asked for or running; whether it is so."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._fitting, timeout_s)

    def close(self) -> None:
        """Stop the background fitter (the server's shutdown); fits asked for later run
        no more."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            fitter = self._fitter
        if fitter is not None:
            fitter.join(timeout=5.0)

    def step_time(self, prefill: int, decoders: int, kv: int) -> float:
        """Seconds for a step of ``prefill`` prompt tokens (one chunk from position 0)
        beside ``decoders`` sequences attending ``kv`` tokens (0 with no model)."""
        with self._lock:
            cost = self._cost
        if cost is None:
            return 0.0
        return cost.prompt_step(prefill, decoders, kv)

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
