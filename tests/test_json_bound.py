"""The JSON length bound: worked out where a schema is bounded, None elsewhere, and
never below what the grammar really lets an answer write (random walks through
llguidance's own masks, one byte a token, that prefer going on to ending)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duetime.core.grammar import GrammarSpec
from duetime.core.json_bound import max_json_bytes
from duetime.engine.grammar import GrammarCompiler
from duetime.server.codec import ByteCodec

CODEC = ByteCodec()
EOS = 1


@pytest.mark.parametrize(
    ("schema", "most"),
    [
        ({"type": "boolean"}, 5),
        ({"type": "null"}, 4),
        ({"enum": ["cup", "bottle"]}, 8),
        ({"const": "é"}, len('"\\u00e9"')),  # the longer spelling of the two
        ({"type": "integer", "minimum": -5, "maximum": 300}, 3),
        ({"type": "integer", "minimum": -1000, "maximum": 9}, 5),
        ({"type": "string", "maxLength": 3}, 2 + 18),
        ({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, 2 + 15 + 4),
        ({"type": "array", "items": {"type": "string"}, "maxItems": 0}, 2),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "boolean"}, "bb": {"const": 1}},
                "additionalProperties": False,
            },
            len('{"a": false, "bb": 1}'),
        ),
        ({"anyOf": [{"type": "boolean"}, {"const": "longer"}]}, 8),
        ({"type": ["boolean", "null"]}, 5),
        (
            {
                "$defs": {"T": {"enum": ["cup", "plate"], "title": "T"}},
                "type": "object",
                "properties": {"t": {"$ref": "#/$defs/T"}},
                "additionalProperties": False,
                "title": "Root",
            },
            len('{"t": "plate"}'),
        ),
    ],
)
def test_bounded_schemas(schema: dict[str, Any], most: int) -> None:
    assert max_json_bytes(schema) == most


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number"},
        {"type": "string"},
        {"type": "array", "items": {"type": "boolean"}},
        {"type": "object", "properties": {"a": {"type": "boolean"}}},  # extra keys allowed
        {"allOf": [{"type": "boolean"}]},
        {"$ref": "https://example.invalid/schema.json"},
        {"$ref": "#/$defs/missing"},
        {"type": "integer", "minimum": 0},
        {"enum": []},
        {},
        True,
        {"anyOf": [{"type": "boolean"}, {"type": "number"}]},
    ],
)
def test_unbounded_or_unknown_schemas_have_no_bound(schema: Any) -> None:
    assert max_json_bytes(schema) is None


def test_a_chained_ref_loop_gives_up() -> None:
    schema = {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
    assert max_json_bytes(schema) is None


def test_the_grammar_spec_caps_tokens_at_the_bound_plus_eos() -> None:
    spec = GrammarSpec.json_schema({"enum": ["cup", "bottle"]}, "x")
    assert spec.max_answer_tokens() == 9
    assert GrammarSpec.json_schema({"type": "string"}, "x").max_answer_tokens() is None
    assert GrammarSpec("regex", "a{3}", "x").max_answer_tokens() is None


# --- never below what the grammar allows ---------------------------------------------

_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(max_size=4), min_size=1, max_size=3, unique=True).map(lambda vs: {"enum": vs}),
    st.one_of(st.integers(-50, 50), st.text(max_size=3), st.booleans()).map(lambda v: {"const": v}),
    st.tuples(st.integers(-2000, 50), st.integers(0, 5000)).map(
        lambda t: {"type": "integer", "minimum": min(t), "maximum": max(t)}
    ),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
)


def _extend(children: Any) -> Any:
    keys = st.text(alphabet="abcé_", min_size=1, max_size=3)
    return st.one_of(
        st.tuples(children, st.integers(0, 3)).map(
            lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
        ),
        st.dictionaries(keys, children, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        ),
        st.lists(children, min_size=1, max_size=3).map(lambda bs: {"anyOf": bs}),
    )


SCHEMAS = st.recursive(_LEAVES, _extend, max_leaves=6)


def _longest_walk(compiler: GrammarCompiler, schema: dict[str, Any], seed: int, cap: int) -> int:
    """Bytes of the longest of a few random walks through the grammar's masks (each step
    a random allowed token, ending only when nothing but the end is allowed), or
    ``cap + 1`` for a walk that got past ``cap``."""
    rng = random.Random(seed)
    longest = 0
    for _ in range(6):
        g = compiler.grammar(GrammarSpec.json_schema(schema, "x"))
        n = 0
        while not g.finished and n <= cap:
            allowed = [t for t in g.allowed().nonzero().flatten().tolist() if t != EOS]
            if not allowed:
                break  # only the end is left
            assert g.accept(rng.choice(allowed))
            n += 1
        longest = max(longest, n)
    return longest


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_no_walk_through_the_grammar_is_longer_than_the_bound(schema: Any, seed: int) -> None:
    most = max_json_bytes(schema)
    assert most is not None, json.dumps(schema)  # every drawn schema is bounded
    compiler = _COMPILER
    walked = _longest_walk(compiler, schema, seed, most)
    assert walked <= most, (json.dumps(schema), walked, most)


_COMPILER = GrammarCompiler(CODEC.guidance_tokenizer)
