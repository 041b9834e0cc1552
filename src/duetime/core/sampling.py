"""How a request picks its tokens: plain data the API builds and the engine's sampler reads.

It lives in ``core`` (no torch) because the API schemas build it, and the
gateway imports those schemas without the engine. The draws themselves are
:class:`duetime.engine.sampling.Sampler`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_LOGIT_BIAS", "MAX_PENALTY", "SamplingParams"]

#: OpenAI's range for presence and frequency penalties.
MAX_PENALTY = 2.0
#: OpenAI's range for a logit bias (-100 bans a token in effect, 100 all but forces it).
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The defaults are greedy decoding over the model's own logits.

    ``temperature`` 0 (or ``top_k`` 1) takes the arg-max, whatever ``top_p``
    and ``min_p`` say. ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 keep every token;
    ``min_p`` drops those less likely than ``min_p`` times the likeliest. ``seed`` makes the
    draws reproducible (None: a fresh random seed per request). ``logit_bias``
    (token id, bias) pairs are added to the logits first, greedy or not (OpenAI's
    field). The penalties change the logits next, as vLLM applies them: each token of
    the prompt or the answer so far has a positive logit divided by
    ``repetition_penalty`` and a negative one multiplied by it; then each token
    of the answer so far loses ``presence_penalty`` once and
    ``frequency_penalty`` per occurrence.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and abs(v) <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {token}: {bias}"
                )
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        """Whether the token is the arg-max (of the penalised logits, if any)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )

    @property
    def plain(self) -> bool:
        """The arg-max of the logits as they are: the engine needs no sampler for it."""
        return self.greedy and not self.penalised and not self.logit_bias
