"""Structured outputs: each answer token masked to what the request's grammar allows.

A request that asks for a JSON schema, a regular expression, a choice of strings or
a context-free grammar (:class:`~duetime.core.grammar.GrammarSpec`) gets a
:class:`TokenGrammar`: before its token is picked (arg-max or sampler), every
token the grammar cannot take next gets a logit of −∞; the picked token then
advances the grammar. When the grammar is complete and can take nothing more, the
answer ends there (finish reason "stop"), a step earlier than waiting for the
model's end-of-sequence. ``max_tokens`` still cuts it short ("length"), as OpenAI
does.

Why llguidance (the engine behind vLLM's ``guidance`` back-end and llama.cpp's
``--grammar``): one 3 MB wheel with no dependencies, where xgrammar pulls in
triton. On Gemma's 262,144-token vocabulary its token table takes ~2 s to build,
once per process (on the first structured request), and a mask 0.01-0.15 ms a
token here; applying it to the logits row costs ~0.3 ms more.

Log-probabilities stay those of the model's own logits (as for the penalties, and
vLLM's default): the mask decides which token comes, not what the model thought
of it. A policy restart replays the answer token for token; :meth:`TokenGrammar.reset`
lets the grammar follow it again from the start.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from duetime.core.grammar import AnswerWork, GrammarSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["JSON_OPTIONS", "GrammarCompiler", "GrammarError", "TokenGrammar"]

#: JSON as Python's ``json.dumps`` writes it (", " and ": "), and no other whitespace:
#: with free whitespace a small model can fill ``max_tokens`` with newlines inside a
#: valid but endless object (a schema's ``x-guidance`` may still say otherwise).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the request field."""

    def __init__(self, spec: GrammarSpec, problem: str) -> None:
        super().__init__(f"{spec.field}: {problem}")
        self.field = spec.field


class TokenGrammar:
    """One sequence's place in its grammar: which tokens may come next, and the
    ones that came."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bits: bytes | None = None  # the next token's bitmask, until a token comes

    def _bitmask(self) -> bytes:
        if self._bits is None:
            self._bits = self._matcher.compute_bitmask()
        return self._bits

    def allows(self, token: int) -> bool:
        """Whether the grammar takes ``token`` next (one bit of the mask: a greedy row
        whose arg-max is allowed needs no masked copy of its logits)."""
        bits = self._bitmask()
        return 0 <= token < self.vocab_size and bool(bits[token >> 3] >> (token & 7) & 1)

    def allowed(self) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens the grammar takes next (the model's
        end-of-sequence where it is complete)."""
        bits = np.frombuffer(self._bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size]).bool()

    def allowed_ids(self, limit: int) -> torch.Tensor | None:
        """The ids of the tokens the grammar takes next, when there are 1 to ``limit``
        of them (else None): a row that needs only their logits skips the output
        layer's product over the whole vocabulary (``Gemma3.logits``' ``allowed``)."""
        bits = np.frombuffer(self._bitmask(), dtype=np.uint8)
        if not 0 < int(np.bitwise_count(bits).sum()) <= limit:
            return None
        ids = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.vocab_size])
        return torch.from_numpy(ids) if len(ids) else None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the ``[vocab]`` row ``logits`` with every token the grammar does not
        take next at −∞ (so are ids past the tokenizer's vocabulary)."""
        allowed = self.allowed()[: len(logits)]
        if len(allowed) < len(logits):
            allowed = torch.cat([allowed, allowed.new_zeros(len(logits) - len(allowed))])
        return logits.masked_fill(~allowed, -torch.inf)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False where the grammar does not take it (the
        grammar is then :attr:`finished` in an error state)."""
        self._bits = None
        return bool(self._matcher.consume_token(int(token)))

    def take_forced(self) -> list[int]:
        """The tokens the grammar forces from here (its only way on, as the tokenizer
        writes it: ``{"action": "`` after a JSON object opens), advanced past; [] where
        the next token is a choice."""
        forced: list[int] = []
        for token in self._matcher.compute_ff_tokens():
            if not self.accept(token):
                break
            forced.append(int(token))
        return forced

    @property
    def finished(self) -> bool:
        """Whether the grammar takes no more tokens (complete, or broken by a token it
        refused): the answer ends here."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        """Why the grammar broke ("" while it has not)."""
        return str(self._matcher.get_error())

    def reset(self) -> None:
        """Back to the answer's start (a restarted sequence generates it again)."""
        self._bits = None
        self._matcher.reset()

    def copy(self) -> TokenGrammar:
        """An independent grammar at the same place (another choice of the request)."""
        return TokenGrammar(self._matcher.deep_copy(), self.vocab_size)

    def choice_steps(self, *, fanout: int = 64, limit: int = 256) -> AnswerWork | None:
        """Engine work an answer from here takes when its forced runs jump (its steps
        and the forced rows riding in them), the model's choices walked without the
        model; None where it cannot be told.

        A step makes one token from the model's logits, its forced run rides along
        in the next step (the grammar's tail needs no step), and an answer that opens
        with a forced run takes its prefill step for the run's first token (the rest
        ride): the steps are the choices, plus that one; the rows, every forced token
        but that first one and the tail.
        Where a choice is open, the walk takes the token after which the grammar forces
        the fewest (ties: the smaller id), so it leans to more steps. It gives up (None)
        where more than ``fanout`` tokens are allowed (free text: the model's choices
        are not the grammar's to count) or past ``limit`` choices. This grammar does
        not move (the walk runs on copies); a few milliseconds on Gemma's vocabulary.
        """
        g = self.copy()
        opening = len(g.take_forced())
        steps = 1 if opening else 0
        rows = 0
        run = max(opening - 1, 0)  # the latest forced run: rides unless it ends the answer
        while not g.finished:
            options = torch.nonzero(g.allowed()).flatten().tolist()
            if not options or len(options) > fanout or steps >= limit:
                return None
            best: tuple[int, int, TokenGrammar] | None = None
            for token in options:
                after = g.copy()
                if not after.accept(token):
                    continue
                forced = len(after.take_forced())
                if best is None or (forced, token) < best[:2]:
                    best = (forced, token, after)
            if best is None:
                return None
            rows += run
            run, _, g = best
            steps += 1
        return AnswerWork(max(steps, 1), rows)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s against one tokenizer into :class:`TokenGrammar` s.

    ``make_tokenizer`` builds llguidance's view of the tokenizer (its token table:
    ~2 s for Gemma's), called once, on the first compile. Compiled grammars are
    kept (the last ``cache_size``), so clients repeating one schema pay for it once.
    Thread-safe: the server compiles on worker threads.
    """

    def __init__(
        self, make_tokenizer: Callable[[], llguidance.LLTokenizer], cache_size: int = 64
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for ``spec``, checked against the tokenizer; raises
        :class:`GrammarError` naming what is wrong."""
        key = (spec.kind, spec.text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tokenizer = self.tokenizer
        if spec.kind == "choice":
            _check_choices(spec)
        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, JSON_OPTIONS)
            else:
                grammar = llguidance.grammar_from(spec.kind, spec.text)
        except ValueError as err:
            raise GrammarError(spec, _summary(str(err))) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(spec, _summary(messages[0] if messages else ""))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def grammar(self, spec: GrammarSpec) -> TokenGrammar:
        """A fresh :class:`TokenGrammar` for one sequence's answer under ``spec``."""
        grammar = self.compile(spec)
        tokenizer = self.tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(spec, _summary(matcher.get_error()))
        return TokenGrammar(matcher, tokenizer.vocab_size)


def _check_choices(spec: GrammarSpec) -> None:
    try:
        options = json.loads(spec.text)
    except ValueError:
        options = None
    if not isinstance(options, list) or not options:
        raise GrammarError(spec, "a choice needs a non-empty JSON list of strings")
    if not all(isinstance(o, str) and o for o in options):
        raise GrammarError(spec, "every choice must be a non-empty string")


def _summary(message: str) -> str:
    """llguidance's error in one line: its first, plus the ``error:`` line a regex
    parse error puts under a picture of where it failed."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return (
        lines[0]
        if detail is None
        else f"{lines[0].rstrip(':')}: {detail.removeprefix('error:').strip()}"
    )
