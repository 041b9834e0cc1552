"""How many engine steps a grammar's answers take, learned from the answers served.

Under a grammar most of an answer may be forced (a JSON object's keys and
punctuation, the rest of an enum value), and forced runs ride along in one step
(jump-forward, ``engine/executor.py``): a robot command of 28 tokens took 5
steps on Gemma 3 270M. Admission assumes a step a token, so with only the
grammar's longest text to go by (``GrammarSpec.max_answer_tokens``, a byte a
token) it took such a request for many times longer than it is and refused it
under a deadline it would meet. Every answer that ends records the steps it
took (its tokens less those it jumped) under its grammar; a later request under
the same grammar is assumed to take at most the most steps of the recent ones.
Until a grammar's first answer ends, nothing is assumed (a step a token).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from duetime.core.grammar import GrammarSpec

__all__ = ["GrammarSteps"]


class GrammarSteps:
    """Per grammar, the steps its last ``window`` answers took (at most ``grammars`` kept,
    the least recently used dropped)."""

    def __init__(self, *, window: int = 16, grammars: int = 256) -> None:
        if window < 1 or grammars < 1:
            raise ValueError(f"window and grammars must be >= 1, got {window}, {grammars}")
        self._window = window
        self._grammars = grammars
        self._steps: OrderedDict[tuple[str, str], deque[int]] = OrderedDict()
        self._lock = threading.Lock()  # answers end on the engine's side, admission reads

    @staticmethod
    def _key(spec: GrammarSpec) -> tuple[str, str]:
        return (spec.kind, spec.text)

    def observe(self, spec: GrammarSpec, tokens: int, jumped: int) -> None:
        """One answer under ``spec`` ended whole with ``tokens`` tokens, ``jumped`` of them
        forced without a step of their own."""
        if tokens < 1 or not 0 <= jumped < tokens:
            return  # (an answer needs a step for its first token)
        key = self._key(spec)
        with self._lock:
            seen = self._steps.get(key)
            if seen is None:
                seen = self._steps[key] = deque(maxlen=self._window)
                while len(self._steps) > self._grammars:
                    self._steps.popitem(last=False)
            self._steps.move_to_end(key)
            seen.append(tokens - jumped)

    def most(self, spec: GrammarSpec) -> int | None:
        """The most steps a recent answer under ``spec`` took; None before the first."""
        with self._lock:
            seen = self._steps.get(self._key(spec))
            return None if not seen else max(seen)
