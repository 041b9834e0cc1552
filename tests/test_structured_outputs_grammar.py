"""Structured outputs: the grammar alone, before any model.

A grammar compiled for the byte codec (one token per byte, ids shifted by 3): the
tokens it allows next, where it is complete, its copies and resets, and the errors
a bad grammar raises, each naming the request field it came from.
"""

from __future__ import annotations

import pytest

from duetime.core.grammar import GrammarSpec
from duetime.engine.grammar import GrammarCompiler, GrammarError
from duetime.server.codec import ByteCodec
from tests.grammar_cases import CHOICES
from tests.grammar_fixtures import compiler_fixture  # noqa: F401 (pytest fixtures)

# --- the grammar alone ---------------------------------------------------------------


def test_a_grammar_allows_only_its_next_tokens_and_ends_where_it_is_complete(
    compiler: GrammarCompiler,
) -> None:
    g = compiler.grammar(GrammarSpec.choice(CHOICES, "choice"))
    start = set(g.allowed().nonzero().flatten().tolist())
    assert start == {ord("h") + 3, ord("w") + 3}
    for byte in b"hel":
        assert g.accept(byte + 3)
    assert set(g.allowed().nonzero().flatten().tolist()) == {ord("l") + 3, ord("p") + 3}
    allowed = g.allowed()
    assert [g.allows(t) for t in range(ByteCodec.vocab_size)] == allowed.tolist()
    assert not g.allows(-1)
    assert not g.allows(ByteCodec.vocab_size)
    row = g.mask(__import__("torch").zeros(ByteCodec.vocab_size))
    assert row.isfinite().sum() == 2
    assert g.accept(ord("p") + 3)
    assert g.finished
    assert not compiler.grammar(GrammarSpec.choice(CHOICES, "choice")).accept(ord("x") + 3)


def test_allowed_ids_lists_a_few_next_tokens_and_gives_up_past_the_limit(
    compiler: GrammarCompiler,
) -> None:
    g = compiler.grammar(GrammarSpec.choice(CHOICES, "choice"))
    ids = g.allowed_ids(2)
    assert ids is not None
    assert ids.tolist() == sorted([ord("h") + 3, ord("w") + 3])
    assert ids.tolist() == g.allowed().nonzero().flatten().tolist()
    assert g.allowed_ids(1) is None  # two allowed: more than the limit
    free = compiler.grammar(GrammarSpec("regex", "[a-z]+", "regex"))
    assert free.allowed_ids(10) is None  # 26 letters
    assert len(free.allowed_ids(26)) == 26  # type: ignore[arg-type]


def test_reset_and_copy_give_independent_grammars(compiler: GrammarCompiler) -> None:
    g = compiler.grammar(GrammarSpec("regex", "ab|ac", "regex"))
    assert g.accept(ord("a") + 3)
    twin = g.copy()
    assert twin.accept(ord("b") + 3)
    assert twin.finished
    assert not g.finished
    g.reset()
    assert set(g.allowed().nonzero().flatten().tolist()) == {ord("a") + 3}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("regex", "(a", "structured_outputs.regex"), "unclosed group"),
        (GrammarSpec.json_schema({"type": 5}, "response_format"), "type must be"),
        (GrammarSpec("json_schema", "{not json", "guided_json"), "guided_json"),
        (GrammarSpec("grammar", "start: undefined_rule", "structured_outputs.grammar"), ""),
        (GrammarSpec("choice", "[]", "guided_choice"), ""),
    ],
)
def test_a_bad_grammar_is_an_error_naming_its_field(
    compiler: GrammarCompiler, spec: GrammarSpec, words: str
) -> None:
    with pytest.raises(GrammarError) as err:
        compiler.grammar(spec)
    assert err.value.field == spec.field
    assert str(err.value).startswith(spec.field + ": ")
    assert words in str(err.value)
