"""How a request picks its tokens: plain data the API builds and the engine's sampler reads.

It lives in ``core`` (no torch) because the API schemas build it, and the
gateway imports those schemas without the engine. The draws themselves are
:class:`duetime.engine.sampling.Sampler`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The defaults are greedy decoding.

    ``temperature`` 0 is greedy (arg-max), whatever the other fields say.
    ``top_k`` 0 keeps every token; ``top_p`` 1 keeps every token. ``seed``
    makes the draws reproducible (None: a fresh random seed per request).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Whether every draw is the arg-max (no sampler is needed)."""
        return self.temperature == 0 or self.top_k == 1
