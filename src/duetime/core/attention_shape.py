"""The attention work of one prompt chunk, as the engine's kernels compute it.

The step-cost model's ``A`` term prices a prompt chunk's attention. Without an
:class:`AttentionShape`, a chunk of ``rows`` queries ending at ``end`` costs
``rows·end``: every query against every key up to the chunk's end. That is what a
dense model computes, and what the shipped profiles were fitted to.

Gemma 3 is not dense in its keys: five layers in six are sliding-window layers,
whose queries see only the last ``window`` keys, and the engine runs a prompt
chunk by one of three kernels (:func:`duetime.engine.attention.attend_prefill`):

* a whole prompt within the window (every layer, or a global layer at any
  length): one causal call, ``rows²`` scores. Torch's CPU kernel masks the upper
  triangle rather than skipping it: fitted as a triangle ``rows·(rows+1)/2`` apart
  from the masked calls, a causal score cost 1.6-1.9x a masked one (three
  profiles), so it is counted as the whole square;
* a chunk of at most ``block`` rows: one masked call over all the keys the layer
  holds, ``rows·keys`` (a sliding layer holds its last ``window - 1`` keys before
  the chunk);
* a longer chunk: blocks of ``block`` queries, each over the keys it may see.

Priced that way (the layers' mean), held-out prompt MAPE fell from 6.9 / 7.1 /
7.7 / 11.4 % to 6.0 / 6.0 / 6.7 / 10.6 % on four q8 profiles' steps (eight splits
each): ``rows·end`` overpriced whole prompts past the window (their sliding layers
see 512 keys, not 1,024) and bent ``a2`` down to meet them (results.md#attention-shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AttentionShape", "AttentionShapeError"]


class AttentionShapeError(ValueError):
    """An attention shape that describes no model."""


@dataclass(slots=True, frozen=True)
class AttentionShape:
    """Where a model's prompt attention changes kernel, and how many of its layers slide.

    ``window``: keys a sliding layer's query sees (itself included); ``sliding_layers``
    of ``layers`` slide; ``block``: queries per call in a long chunk.
    """

    window: int
    sliding_layers: int
    layers: int
    block: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.block < 1 or self.layers < 1:
            raise AttentionShapeError(
                f"window, block and layers must be >= 1, got {self.window}, {self.block}, "
                f"{self.layers}"
            )
        if not 0 <= self.sliding_layers <= self.layers:
            raise AttentionShapeError(
                f"sliding_layers must lie in 0..{self.layers}, got {self.sliding_layers}"
            )

    def work(self, rows: float, end: float) -> float:
        """The chunk's attention scores per layer (the layers' mean): ``rows`` queries
        computed, the last at position ``end - 1``, after ``end - rows`` cached keys."""
        if rows <= 0:
            return 0.0
        past = end - rows
        slide = self.sliding_layers
        total = (self.layers - slide) * self._layer(rows, past, None)
        if slide:
            total += slide * self._layer(rows, past, self.window)
        return total / self.layers

    def _layer(self, rows: float, past: float, window: int | None) -> float:
        """One layer's scores; ``window`` None for a global layer."""
        if past <= 0 and (window is None or rows <= window):
            return rows * rows  # one causal call
        first = 0.0 if window is None else max(0.0, past - (window - 1))
        if rows <= self.block:
            return rows * (past + rows - first)  # one masked call over the held keys
        total, a = 0.0, 0.0
        while a < rows:  # blocks, each over the keys it may see
            b = min(a + self.block, rows)
            lo = first if window is None else max(first, past + a - window + 1)
            total += (b - a) * (past + b - lo)
            a = b
        return total

    def as_dict(self) -> dict[str, int]:
        return {
            "window": self.window,
            "sliding_layers": self.sliding_layers,
            "layers": self.layers,
            "block": self.block,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> AttentionShape:
        fields = ("window", "sliding_layers", "layers", "block")
        if not isinstance(raw, Mapping) or set(raw) != set(fields):
            raise AttentionShapeError(f"an attention shape needs exactly {list(fields)}")
        values = [raw[k] for k in fields]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise AttentionShapeError(f"attention shape fields must be integers, got {values}")
        return cls(*values)
