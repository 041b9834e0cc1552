"""Structured outputs in admission: a grammar's lengths, steps and rows.

Each test serves the tiny model with a step-time profile of its own: a choice or a
bounded schema caps the predicted length, the answers under a grammar give its
next prediction, admission counts the steps its answers take (forced runs jump),
and a forecast charges the forced rows riding in those steps.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from duetime.core.grammar import GrammarSpec
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from tests.grammar_cases import RESPONSE_SCHEMA, SCHEMA


def test_a_choice_bounds_the_predicted_length_and_admission_judges_by_it(
    tmp_path: Any,
) -> None:
    """An answer from a choice can be no longer than its longest option (a token holds
    a byte at least) plus the end-of-sequence, one under a bounded JSON schema no longer
    than its longest text: the prediction policies and admission use is capped there.
    With 100 ms a decode step, 64 tokens cannot meet a 2 s deadline; the same request
    held to "yes" / "no" (at most 4 tokens) can, and one held to a small schema (32)
    meets 4 s."""
    profile = tmp_path / "decode-bound.json"
    profile.write_text(
        json.dumps({"name": "decode-bound", "coefficients": {"c0": 0.1, "a1": 1e-4}})
    )
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    with TestClient(create_app(build_state(options, m, codec, name))) as c:
        body = {"model": name, "prompt": "ok?", "max_tokens": 64, "ignore_eos": True}
        free = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert free.status_code == 429, free.text
        assert "64 tokens assumed for this answer" in free.json()["error"]["message"]
        # (before any answer: the server's step-time fit then still is the profile's)
        held = {**body, "deadline_ms": 2000, "guided_choice": ["yes", "no"]}
        regex = c.post("/v1/completions", json={**held, "guided_choice": None, "guided_regex": "y"})
        # a regex's longest text is not worked out (max_tokens), but the grammar's walk
        # counts the one step "y" takes
        assert regex.status_code == 200, regex.text
        free_json = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
        r = c.post(
            "/v1/completions", json={**held, "guided_choice": None, "response_format": free_json}
        )
        assert r.status_code == 429  # any object: unbounded
        r = c.post("/v1/completions", json=held)
        assert r.status_code == 200, r.text
        assert r.json()["duetime"]["predicted_tokens"] == 4  # "yes" + end-of-sequence
        assert r.json()["choices"][0]["text"] in ("yes", "no")
        # a JSON schema whose every part is bounded: its longest text ('{"ok": false,
        # "color": "green"}', 31 bytes) + the end-of-sequence
        schema = {**held, "guided_choice": None, "response_format": RESPONSE_SCHEMA}
        r = c.post("/v1/completions", json={**schema, "deadline_ms": 4000})
        assert r.status_code == 200, r.text
        assert r.json()["duetime"]["predicted_tokens"] == 32


def test_the_answers_under_a_grammar_give_its_predicted_length() -> None:
    """The length predictor reads only the prompt (trained on chat answers); under a
    grammar the answers that ended say how long the next one is. Before any, the
    prediction is the predictor's (here none); after, the median of the answers,
    sampled or greedy, logprobs or not (``predicted_tokens`` reports the request's
    ``predicted``, which the policy reads)."""
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    body = {"model": name, "prompt": "ok?", "max_tokens": 64, "response_format": RESPONSE_SCHEMA}
    with TestClient(create_app(state)) as c:
        first = c.post("/v1/completions", json=body).json()
        assert first["duetime"]["predicted_tokens"] is None
        tokens = [first["usage"]["completion_tokens"]]
        for extra in ({"temperature": 1.0, "seed": 3}, {"logprobs": 1}, {}):
            r = c.post("/v1/completions", json={**body, **extra}).json()
            tokens.append(r["usage"]["completion_tokens"])
        assert max(tokens) < 32
        r = c.post("/v1/completions", json=body).json()
        want = sorted(tokens)[1:3]
        assert r["duetime"]["predicted_tokens"] == sum(want) / 2  # the median of four
        # another grammar knows nothing yet
        other = {**body, "response_format": None, "guided_choice": ["yes", "no"]}
        assert c.post("/v1/completions", json=other).json()["duetime"]["predicted_tokens"] is None


def test_admission_counts_the_steps_a_grammars_answers_take(tmp_path: Any) -> None:
    """Forced runs jump (the schema's keys and punctuation ride along): its answers take
    far fewer steps than tokens. A step for each of the 32 tokens its longest text may
    take would be 3.2 s at 100 ms a step, past a 2 s deadline; the grammar's own walk
    counts a few steps, and once answers have ended, the most steps they took rule.
    Where the grammar leaves free text (a name) there is no walk: a step a token."""
    profile = tmp_path / "decode-bound.json"
    profile.write_text(
        json.dumps({"name": "decode-bound", "coefficients": {"c0": 0.1, "a1": 1e-4}})
    )
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    with TestClient(create_app(state)) as c:
        body = {
            "model": name,
            "prompt": "ok?",
            "max_tokens": 64,
            "response_format": RESPONSE_SCHEMA,
        }
        assert state.grammar_steps.most(spec) is None
        first = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert first.status_code == 200, first.text  # by the walk, before any answer
        tokens = first.json()["usage"]["completion_tokens"]
        work = state.grammar_steps.most(spec)
        assert work is not None
        assert 1 <= work.steps < tokens / 3  # most of the JSON was forced
        assert work.steps + work.rows < tokens  # (its last forced run needed no row)
        again = c.post("/v1/completions", json={**body, "deadline_ms": 2000})
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # with log-probabilities its tokens come a step each: nothing is discounted, and
        # the tokens are as many as its two answers had (not the 32 of its longest text)
        one_by_one = {**body, "deadline_ms": 2000, "logprobs": 1}
        refused = c.post("/v1/completions", json=one_by_one)
        assert refused.status_code == 429
        assert f"{tokens} tokens assumed for this answer" in refused.json()["error"]["message"]
        named = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}},
            "required": ["name"],
            "additionalProperties": False,
        }
        free = {"type": "json_schema", "json_schema": {"schema": named}}
        late = c.post(
            "/v1/completions", json={**body, "response_format": free, "deadline_ms": 2000}
        )
        assert late.status_code == 429, late.text  # free text: no walk, a step a token
        assert state.grammar_steps.most(GrammarSpec.json_schema(named, "x")) is None


def test_a_forecast_charges_the_forced_rows_riding_in_a_grammars_steps(tmp_path: Any) -> None:
    """A structured answer takes few steps, but its forced runs are computed as rows of
    them. With rows that cost (20 ms each, the steps 100 ms), the forecast of an answer
    under a schema is its steps and its rows: ``steps·c0 + a1·(prompt rows + riding
    rows)``, and a deadline its steps alone would meet but its rows do not is refused."""
    profile = tmp_path / "row-bound.json"
    profile.write_text(json.dumps({"name": "row-bound", "coefficients": {"c0": 0.1, "a1": 0.02}}))
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile)
    m, codec, name = load_served_model(options)
    state = build_state(options, m, codec, name)
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    body = {"model": name, "prompt": "ok?", "max_tokens": 64, "response_format": RESPONSE_SCHEMA}
    with TestClient(create_app(state)) as c:
        first = c.post("/v1/completions", json={**body, "deadline_ms": 5000})
        assert first.status_code == 200, first.text
        work = state.grammar_steps.most(spec)
        assert work is not None
        assert work.rows >= 10  # the keys and punctuation rode along
        prompt = first.json()["usage"]["prompt_tokens"]
        # (the engine's image, which the forecast starts from, no longer holds it)
        assert state.engine.image is not None
        assert not state.engine.image.seqs
        again = c.post("/v1/completions", json={**body, "deadline_ms": 5000})
        assert again.status_code == 200, again.text
        forecast_s = again.json()["duetime"]["predicted_e2e_ms"] / 1000
        low = work.steps * 0.1 + 0.02 * (1 + work.rows)  # (the prompt from the cache, at most)
        high = work.steps * 0.1 + 0.02 * (prompt + work.rows)
        assert low - 1e-6 <= forecast_s <= high + 1e-6, (forecast_s, low, high, work)
        # a deadline the steps alone meet (with the whole prompt to compute) is refused
        steps_only_ms = 1000 * (work.steps * 0.1 + 0.02 * prompt)
        assert steps_only_ms + 1 < 1000 * low
        tight = c.post("/v1/completions", json={**body, "deadline_ms": steps_only_ms + 1})
        assert tight.status_code == 429, tight.text
