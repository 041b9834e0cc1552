"""The engine work a grammar's answers take: from the grammar, then from the answers.

Under a grammar most of an answer may be forced (a JSON object's keys and
punctuation, the rest of an enum value), and forced runs ride along in one step
(jump-forward, ``engine/executor_forced.py``): a robot command of 28 tokens took 5
steps on Gemma 3 270M. Admission assumes a step a token, so with only the
grammar's longest text to go by (``GrammarSpec.max_answer_tokens``, a byte a
token) it took such a request for many times longer than it is and refused it
under a deadline it would meet.

The steps are not all of it: a forced run rides along as extra rows of a step,
and 22 of that command's tokens did (its last forced token needed none). A
forecast that took 5 one-row steps had the command done in 0.73x the time it
took (median of ten); the work is therefore kept as an :class:`AnswerWork`,
steps and riding rows, and the simulator charges the rows (``Job.ride_rows``).

Two sources, per grammar. Before any answer: a prior from the grammar alone
(:meth:`TokenGrammar.choice_steps`: its forced runs walked, the model's choices
counted where they are few; none for free text). Then every answer that ends
records the work it took (its tokens less those it jumped; those that rode),
and a later request is assumed to take at most the most steps, and the most
rows, of the recent ones. Where neither is known, nothing is assumed (a step a
token).

The same answers also say how long an answer under the grammar is, in tokens,
which is what policies read (``Request.predicted``: SJF's order, TimeBill's
WCET and eviction ratio, Amax's reservation). The length predictor knows only
the prompt and was trained on free chat answers: for a robot's JSON command it
predicts a chat answer's length, and the grammar's longest text caps that at a
bound several times the answer (93 tokens for a command of 28).
:meth:`GrammarSteps.lengths` predicts from the answers that ended whole
under the grammar instead: the median of the recent ones, the interval from the
shortest to the longest (order statistics: a next answer falls inside with
probability ``(n - 1) / (n + 1)``, the confidence given); with fewer than
``MIN_ANSWERS`` answers the top stays at the grammar's bound.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from duetime.core.grammar import AnswerWork, GrammarSpec
from duetime.core.request import LengthPrediction

__all__ = ["MIN_ANSWERS", "GrammarSteps"]

#: Answers a grammar needs before the longest of them, not its bound, tops its interval.
MIN_ANSWERS = 4


def _key(spec: GrammarSpec) -> tuple[str, str]:
    """A grammar's identity: its kind and text (not the request field it came in)."""
    return (spec.kind, spec.text)


@dataclass(slots=True)
class _Grammar:
    prior: AnswerWork | None = None  # from the grammar alone
    walked: bool = False  # whether the prior was worked out (it may be None)
    seen: deque[AnswerWork] = field(default_factory=deque)  # its recent answers' work
    tokens: deque[int] = field(default_factory=deque)  # its recent whole answers' lengths


class GrammarSteps:
    """Per grammar, its prior and the work its last ``window`` answers took (at most
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
        key = _key(spec)
        entry = self._known.get(key)
        if entry is None:
            entry = self._known[key] = _Grammar(
                seen=deque(maxlen=self._window), tokens=deque(maxlen=self._window)
            )
            while len(self._known) > self._grammars:
                self._known.popitem(last=False)
        self._known.move_to_end(key)
        return entry

    def needs_prior(self, spec: GrammarSpec) -> bool:
        """Whether ``spec``'s prior is still to be worked out."""
        with self._lock:
            entry = self._known.get(_key(spec))
            return entry is None or not entry.walked

    def set_prior(self, spec: GrammarSpec, work: AnswerWork | None) -> None:
        """The work the grammar alone says its answers take (None: it cannot say)."""
        with self._lock:
            entry = self._entry(spec)
            ok = work is not None and work.steps >= 1 and work.rows >= 0
            entry.prior = work if ok else None
            entry.walked = True

    def observe(self, spec: GrammarSpec, tokens: int, jumped: int, rode: int = 0) -> None:
        """One answer under ``spec`` ended whole with ``tokens`` tokens, ``jumped`` of them
        forced without a step of their own, ``rode`` of those as rows of a step."""
        if tokens < 1 or not 0 <= jumped < tokens or not 0 <= rode <= jumped:
            return  # (an answer needs a step for its first token)
        with self._lock:
            self._entry(spec).seen.append(AnswerWork(tokens - jumped, rode))

    def most(self, spec: GrammarSpec) -> AnswerWork | None:
        """The most steps and the most riding rows of the recent answers under ``spec``
        (each the most of any), else its prior; None where neither is known."""
        with self._lock:
            entry = self._known.get(_key(spec))
            if entry is None:
                return None
            if not entry.seen:
                return entry.prior
            return AnswerWork(max(w.steps for w in entry.seen), max(w.rows for w in entry.seen))

    def answered(self, spec: GrammarSpec, tokens: int) -> None:
        """An answer under ``spec`` ended whole (the grammar complete) with ``tokens``
        tokens, however it was made (jumping or a step a token)."""
        if tokens >= 1:
            with self._lock:
                self._entry(spec).tokens.append(tokens)

    def lengths(self, spec: GrammarSpec, most: int) -> LengthPrediction | None:
        """The length of a next answer under ``spec``, from the recent whole ones (none:
        None), never over ``most`` tokens (see the module)."""
        with self._lock:
            entry = self._known.get(_key(spec))
            seen = sorted(entry.tokens) if entry is not None else []
        n = len(seen)
        if n == 0:
            return None
        mid = statistics.median(seen)
        if n >= MIN_ANSWERS:
            hi, confidence = float(seen[-1]), (n - 1) / (n + 1)
        else:  # too few to say how long they get: up to the bound
            hi, confidence = float(max(most, seen[-1])), n / (n + 1)
        return LengthPrediction(
            point=float(mid), lo=float(seen[0]), hi=hi, confidence=confidence
        ).capped(most)
