"""Where a served engine round's time goes: one row per round, kept when asked for.

`duetime bench serve-load` reads it to put a loaded server's steps beside the
offline engine's at the same batch. A round of the engine thread is: take the
inbox (``drain``), ask the policy and apply its decision (``schedule``), the
model's forward pass (``forward``), hand the tokens and ends to the event loop
(``deliver``: per-row bookkeeping, then one hand-over), refresh the stats and
the image admission forecasts from, and the step-time fit after the hand-over
(``refresh``), and sleep while there is
nothing to do (``idle``). ``forward`` is the executor's own step time (the same
figure the cost model is fitted on); ``schedule`` is the rest of the tick.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARTS", "StepLog", "StepRow"]

#: A round's parts, in the order they run.
PARTS = ("drain", "schedule", "forward", "deliver", "refresh", "idle")


@dataclass(slots=True, frozen=True)
class StepRow:
    """One round of the engine thread (seconds; the step's shape where one ran)."""

    start: float  # engine clock
    drain: float = 0.0
    schedule: float = 0.0
    forward: float = 0.0
    deliver: float = 0.0
    refresh: float = 0.0
    idle: float = 0.0
    decoders: int = 0
    prefill_tokens: int = 0
    kv_tokens: int = 0

    @property
    def stepped(self) -> bool:
        return self.decoders > 0 or self.prefill_tokens > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "start_s": self.start,
            **{f"{p}_s": getattr(self, p) for p in PARTS},
            "decoders": self.decoders,
            "prefill_tokens": self.prefill_tokens,
            "kv_tokens": self.kv_tokens,
        }


@dataclass(slots=True)
class StepLog:
    """The newest ``capacity`` rounds (a ring: a server left on does not grow)."""

    capacity: int = 200_000
    _rows: deque[StepRow] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        self._rows = deque(maxlen=self.capacity)

    def add(self, row: StepRow) -> None:
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[StepRow]:
        """A copy, safe to read while the engine runs."""
        with self._lock:
            return list(self._rows)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
