"""Structured outputs over HTTP: the served API's constraint forms.

Through one tiny-model server (the module's ``client``): each request form
(``response_format``, ``structured_outputs``, the ``guided_*`` fields) constrains
the answer, streamed, sampled, with several choices or in a chat; a grammar ending
at ``max_tokens`` is a stop; a bad constraint is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from duetime.core.grammar import GrammarSpec
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from tests.grammar_cases import CHOICES, DIGITS, LARK, RESPONSE_SCHEMA, SCHEMA, SPECS, fits

# --- over HTTP -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Any:
    options = ServeOptions(model="tiny", predictor=None, seed=1)
    m, codec, name = load_served_model(options)
    with TestClient(create_app(build_state(options, m, codec, name))) as c:
        yield c, name


def _post(client: Any, path: str = "/v1/completions", **body: Any) -> Any:
    c, name = client
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "Colour?"}])
    else:
        body.setdefault("prompt", "Which colour? ")
    return c.post(path, json={"model": name, "max_tokens": 40, **body})


@pytest.mark.parametrize(
    ("fields", "spec"),
    [
        ({"response_format": RESPONSE_SCHEMA}, SPECS[2]),
        ({"structured_outputs": {"json": SCHEMA}}, SPECS[2]),
        ({"guided_json": json.dumps(SCHEMA)}, SPECS[2]),
        ({"structured_outputs": {"regex": DIGITS}}, SPECS[1]),
        ({"guided_regex": DIGITS}, SPECS[1]),
        ({"structured_outputs": {"choice": CHOICES}}, SPECS[0]),
        ({"guided_choice": CHOICES}, SPECS[0]),
        ({"structured_outputs": {"grammar": LARK}}, SPECS[3]),
        ({"guided_grammar": 'root ::= "x" ("y" | "zz") ("y" | "zz")? "!"'}, SPECS[3]),  # GBNF
    ],
)
def test_each_request_form_constrains_the_answer(
    client: Any, fields: dict[str, Any], spec: GrammarSpec
) -> None:
    r = _post(client, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert fits(spec, choice["text"]), choice["text"]


def test_json_object_mode_gives_a_json_object(client: Any) -> None:
    # (this random model ends its object after "x"; after most prompts it writes an
    # endless number, which JSON allows: "length")
    r = _post(client, prompt="x", response_format={"type": "json_object"}, max_tokens=200)
    choice = r.json()["choices"][0]
    assert r.status_code == 200, r.text
    assert choice["finish_reason"] == "stop", r.text
    assert isinstance(json.loads(choice["text"]), dict)
    endless = _post(client, prompt="hello", response_format={"type": "json_object"}).json()
    assert endless["choices"][0]["text"].startswith('{"": ')
    plain = _post(client, response_format={"type": "text"}, max_tokens=12).json()
    assert not plain["choices"][0]["text"].startswith("{")  # text: no constraint


def test_streamed_sampled_several_choices_and_chat_each_fit(client: Any) -> None:
    c, name = client
    body = {
        "model": name,
        "prompt": "Which colour? ",
        "max_tokens": 40,
        "response_format": RESPONSE_SCHEMA,
        "temperature": 1.5,
        "seed": 2,
        "n": 3,
    }
    whole = c.post("/v1/completions", json=body).json()
    texts = [ch["text"] for ch in sorted(whole["choices"], key=lambda ch: ch["index"])]
    assert all(fits(SPECS[2], t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled: the choices differ
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:] not in ("", "[DONE]")]
    streamed = ["", "", ""]
    for ev in events:
        for ch in ev["choices"]:
            streamed[ch["index"]] += ch["text"]
    assert streamed == texts  # same seeds, same answers
    chat = _post(client, "/v1/chat/completions", structured_outputs={"choice": CHOICES}).json()
    assert chat["choices"][0]["message"]["content"] in CHOICES


def test_a_grammar_complete_at_max_tokens_is_a_stop_and_one_cut_short_a_length(
    client: Any,
) -> None:
    done = _post(client, guided_choice=["ab"], max_tokens=2).json()["choices"][0]
    assert (done["text"], done["finish_reason"]) == ("ab", "stop")
    cut = _post(client, guided_choice=["ab"], max_tokens=1).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("a", "length")
    usage = _post(client, guided_choice=["abc"], max_tokens=30).json()["usage"]
    assert usage["completion_tokens"] == 3  # ended with the grammar, no end-of-sequence step


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "type must be",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", ""),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, None, "one constraint"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_json": "{not json"}, "guided_json", ""),
        # a keyword the grammar cannot enforce: refused, not ignored
        ({"guided_json": {"type": "string", "format": "weird"}}, "guided_json", "weird"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(
    client: Any, fields: dict[str, Any], param: str | None, words: str
) -> None:
    r = _post(client, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert _post(client, max_tokens=2).status_code == 200  # the server goes on
