"""The work a grammar's answers take (steps, and forced rows riding in them), as admission
reads it: the grammar's own walk until its answers say."""

from __future__ import annotations

import pytest

from duetime.core.grammar import AnswerWork, GrammarSpec
from duetime.core.request import LengthPrediction
from duetime.server.grammar_steps import GrammarSteps

A = GrammarSpec.choice(["yes", "no"], "guided_choice")
B = GrammarSpec.json_schema({"type": "object"}, "response_format")


def test_the_most_steps_of_the_recent_answers_per_grammar() -> None:
    steps = GrammarSteps(window=3)
    assert steps.most(A) is None  # nothing seen: a step a token is assumed
    steps.observe(A, tokens=10, jumped=8, rode=6)
    steps.observe(A, tokens=12, jumped=7, rode=3)
    # the most steps of any and the most rows of any: here of different answers
    assert steps.most(A) == AnswerWork(5, 6)
    assert steps.most(B) is None
    # the same grammar from another request field is the same grammar
    assert steps.most(GrammarSpec.choice(["yes", "no"], "structured_outputs")) == AnswerWork(5, 6)
    for _ in range(3):  # the window forgets the older answers
        steps.observe(A, tokens=4, jumped=2)
    assert steps.most(A) == AnswerWork(2, 0)


def test_answers_that_cannot_say_are_not_counted() -> None:
    steps = GrammarSteps()
    steps.observe(A, tokens=0, jumped=0)  # no token made
    steps.observe(A, tokens=5, jumped=5)  # (the first token always takes a step)
    steps.observe(A, tokens=5, jumped=-1)
    steps.observe(A, tokens=5, jumped=2, rode=3)  # more rode than jumped
    steps.observe(A, tokens=5, jumped=2, rode=-1)
    assert steps.most(A) is None


def test_the_least_recently_used_grammar_goes_first() -> None:
    steps = GrammarSteps(grammars=2)
    c = GrammarSpec.choice(["a", "b"], "guided_choice")
    steps.observe(A, 3, 1)
    steps.observe(B, 3, 0)
    steps.observe(A, 3, 1)  # A used again: B is now the oldest
    steps.observe(c, 3, 2)
    assert steps.most(B) is None
    assert steps.most(A) == AnswerWork(2)
    assert steps.most(c) == AnswerWork(1)


def test_the_prior_stands_until_an_answer_ends() -> None:
    steps = GrammarSteps()
    assert steps.needs_prior(A)
    steps.set_prior(A, AnswerWork(6, 20))
    assert not steps.needs_prior(A)
    assert steps.most(A) == AnswerWork(6, 20)
    steps.observe(A, tokens=9, jumped=5, rode=4)  # the answers rule, above or below the prior
    assert steps.most(A) == AnswerWork(4, 4)
    steps.set_prior(B, None)  # the walk could not tell (free text)
    assert not steps.needs_prior(B)  # (and is not walked again)
    assert steps.most(B) is None
    steps.set_prior(B, AnswerWork(0))  # no step is no estimate
    assert steps.most(B) is None
    steps.set_prior(B, AnswerWork(3, -1))  # nor are negative rows
    assert steps.most(B) is None


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="window and grammars"):
        GrammarSteps(window=0)


def test_lengths_come_from_the_whole_answers_under_the_grammar() -> None:
    steps = GrammarSteps(window=5)
    assert steps.lengths(A, 93) is None  # no answer yet: the predictor's word stands
    for n in (10, 30, 20):
        steps.answered(A, n)
    steps.answered(A, 0)  # an empty answer says nothing
    few = steps.lengths(A, 93)
    # the median and the shortest; with fewer than MIN_ANSWERS the top stays the bound
    assert (few.point, few.lo, few.hi) == (20, 10, 93)
    assert few.confidence == pytest.approx(3 / 4)
    assert steps.lengths(B, 93) is None
    steps.answered(A, 40)
    four = steps.lengths(A, 93)
    assert (four.point, four.lo, four.hi) == (25, 10, 40)  # an even count: the middle two
    assert four.confidence == pytest.approx(3 / 5)  # [min, max] of 4 holds a 5th 3 in 5
    assert steps.lengths(A, 15) == LengthPrediction(15, 10, 15, 3 / 5)  # never past `most`
    for _ in range(5):  # the window forgets the older answers
        steps.answered(A, 7)
    assert steps.lengths(A, 93) == LengthPrediction(7, 7, 7, 4 / 6)
    # the work of jumping answers and their lengths are kept apart
    assert steps.most(A) is None
