"""Service-level objectives: the latency targets a request must meet to count as goodput."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class SLO:
    """Per-request latency targets in seconds; ``None`` means "no target".

    A request meets the SLO when it completed and every set target holds
    (``<=``). A request with fewer than two output tokens has no TBT and so
    cannot violate ``tbt_s``. Deadlines are not part of the SLO: they live on
    the request, and :func:`duetime.metrics.summarize` checks them in addition.
    """

    ttft_s: float | None = None
    tbt_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO.{name} must be a positive number or None, got {v!r}")

    def met(self, ttft: np.ndarray, tbt: np.ndarray, e2e: np.ndarray) -> np.ndarray:
        """Boolean mask of requests meeting every target; NaN TTFT/E2E (not completed) fail."""
        ok = ~np.isnan(e2e)
        if self.ttft_s is not None:
            ok &= ttft <= self.ttft_s
        if self.tbt_s is not None:
            ok &= np.isnan(tbt) | (tbt <= self.tbt_s)
        if self.e2e_s is not None:
            ok &= e2e <= self.e2e_s
        return ok
