"""How many engine steps a grammar's answers take: from the grammar, then from the answers.

Under a grammar most of an answer may be forced (a JSON object's keys and
punctuation, the rest of an enum value), and forced runs ride along in one step
(jump-forward, ``engine/executor.py``): a robot command of 28 tokens took 5
steps on Gemma 3 270M. Admission assumes a step a token, so with only the
grammar's longest text to go by (``GrammarSpec.max_answer_tokens``, a byte a
token) it took such a request for many times longer than it is and refused it
under a deadline it would meet.

Two sources, per grammar. Before any answer: a prior from the grammar alone
(:meth:`TokenGrammar.choice_steps`: its forced runs walked, the model's choices
counted where they are few; none for free text). Then every answer that ends
records the steps it took (its tokens less those it jumped), and a later
request is assumed to take at most the most steps of the recent ones. Where
neither is known, nothing is assumed (a step a token).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from duetime.core.grammar import GrammarSpec

__all__ = ["GrammarSteps"]


@dataclass(slots=True)
class _Grammar:
    prior: int | None = None  # from the grammar alone
    walked: bool = False  # whether the prior was worked out (it may be None)
    seen: deque[int] = field(default_factory=deque)  # steps of its recent answers


class GrammarSteps:
    """Per grammar, its prior and the steps its last ``window`` answers took (at most
    ``grammars`` kept, the least recently used dropped)."""

    def __init__(self, *, window: int = 16, grammars: int = 256) -> None:
        if window < 1 or grammars < 1:
            raise ValueError(f"window and grammars must be >= 1, got {window}, {grammars}")
        self._window = window
        self._grammars = grammars
        self._known: OrderedDict[tuple[str, str], _Grammar] = OrderedDict()
        self._lock = threading.Lock()  # answers end on the engine's side, admission reads

    def _entry(self, spec: GrammarSpec) -> _Grammar:
        """(under the lock) ``spec``'s record, made and marked as just used."""
        key = (spec.kind, spec.text)
        entry = self._known.get(key)
        if entry is None:
            entry = self._known[key] = _Grammar(seen=deque(maxlen=self._window))
            while len(self._known) > self._grammars:
                self._known.popitem(last=False)
        self._known.move_to_end(key)
        return entry

    def needs_prior(self, spec: GrammarSpec) -> bool:
        """Whether ``spec``'s prior is still to be worked out."""
        with self._lock:
            entry = self._known.get((spec.kind, spec.text))
            return entry is None or not entry.walked

    def set_prior(self, spec: GrammarSpec, steps: int | None) -> None:
        """The steps the grammar alone says its answers take (None: it cannot say)."""
        with self._lock:
            entry = self._entry(spec)
            entry.prior = steps if steps is None or steps >= 1 else None
            entry.walked = True

    def observe(self, spec: GrammarSpec, tokens: int, jumped: int) -> None:
        """One answer under ``spec`` ended whole with ``tokens`` tokens, ``jumped`` of them
        forced without a step of their own."""
        if tokens < 1 or not 0 <= jumped < tokens:
            return  # (an answer needs a step for its first token)
        with self._lock:
            self._entry(spec).seen.append(tokens - jumped)

    def most(self, spec: GrammarSpec) -> int | None:
        """The most steps a recent answer under ``spec`` took, else its prior; None
        where neither is known."""
        with self._lock:
            entry = self._known.get((spec.kind, spec.text))
            if entry is None:
                return None
            return max(entry.seen) if entry.seen else entry.prior
