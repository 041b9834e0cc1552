"""Text stop checkers (robot actions, sentences, paragraphs) and their wiring into the engine."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from duetime.core.request import Job, Request
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.segment_stop import (
    TextSegmenter,
    make_rule,
    paragraph,
    reading_time_s,
    robot_action,
    sentence,
)
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.server.codec import ByteCodec


def _cut(rule: Any, text: str) -> str | None:
    end = rule.boundary(text)
    return None if end is None else text[:end]


@pytest.mark.parametrize(
    ("text", "segment"),
    [
        ("move(50)\nturn(90)\n", "move(50)\n"),
        ("  mf(50);tc(90)", "  mf(50);"),
        ("1. pick(red_box, {})\n", "1. pick(red_box, {})\n"),
        ("- drone.takeoff()\n", "- drone.takeoff()\n"),
        ("Plan:\nACTION: grasp the cup\nmore", "Plan:\nACTION: grasp the cup\n"),
        ("move(50", None),  # not closed
        ("move(50)", None),  # closed but the line may go on
        ("I will move the arm (slowly).\n", None),  # prose, not a statement
        ("ACTION:   \n", None),  # an empty action
    ],
)
def test_robot_action_regex(text: str, segment: str | None) -> None:
    assert _cut(robot_action(), text) == segment


@pytest.mark.parametrize(
    ("text", "segment"),
    [
        ("Hello there. General", "Hello there."),
        ('He said "Go!" Then', 'He said "Go!"'),
        ("Really? Yes", "Really?"),
        ("Pi is 3.14 today", None),
        ("see e.g.x", None),
        ("The end.", None),  # no whitespace after yet: the next token may be a digit
    ],
)
def test_sentence_boundary(text: str, segment: str | None) -> None:
    assert _cut(sentence(), text) == segment


def test_paragraph_boundary_is_a_blank_line_after_text() -> None:
    rule = paragraph()
    assert _cut(rule, "Line one.\nLine two.\n\nNext") == "Line one.\nLine two.\n\n"
    assert _cut(rule, "\n\nTitle") is None  # leading blank lines are not a paragraph
    assert _cut(rule, "One line.\nTwo") is None


def test_reading_delay_is_300_words_per_minute() -> None:
    assert reading_time_s("one two three four five") == pytest.approx(1.0)
    assert sentence().gap("Ten words take two seconds at three hundred per minute.") == 2.0
    assert paragraph(wpm=600).gap("a b c d e f g h i j") == pytest.approx(1.0)


def test_segmenter_carries_the_rest_of_the_boundary_token() -> None:
    codec = ByteCodec()
    seg = TextSegmenter(sentence(), codec.decode)
    gaps = [seg.add(t) for t in codec.encode("Hi. Yo there. Ok")[1:]]
    assert seg.segments == ["Hi.", " Yo there."]
    assert [g for g in gaps if g is not None] == [pytest.approx(0.2), pytest.approx(0.4)]
    # a token that holds ". N" ends the sentence; "N" starts the next segment's text
    words = {10: "Done", 11: ". N", 12: "ext."}
    seg = TextSegmenter(sentence(), lambda ids: "".join(words[i] for i in ids))
    assert [seg.add(i) for i in (10, 11)][-1] is not None
    assert seg.carry == " N"
    seg.add(12)
    assert seg.add(10) is None
    assert seg.segments == ["Done."]


def test_segmenter_waits_for_a_whole_character() -> None:
    codec = ByteCodec()
    seg = TextSegmenter(sentence(), codec.decode)
    ids = codec.encode("Ça. b")[1:]
    assert seg.add(ids[0]) is None  # first byte of "Ç": U+FFFD, no decision
    assert [seg.add(i) for i in ids[1:]].count(None) == len(ids) - 2
    assert seg.segments == ["Ça."]


def test_segmenter_does_not_wait_forever_on_broken_bytes() -> None:
    every2 = make_rule("regex:(?s)..")
    seg = TextSegmenter(every2, ByteCodec().decode)
    lead = 0xEA + ByteCodec.OFFSET  # a UTF-8 lead byte, never completed
    gaps = [seg.add(lead) for _ in range(TextSegmenter.MAX_HOLD + 1)]
    assert gaps[:-1] == [None] * TextSegmenter.MAX_HOLD
    assert gaps[-1] == 0.0  # checked as text after MAX_HOLD tokens: "\ufffd\ufffd" is 2 chars


def test_bad_rules_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown segment rule 'word'.*sentence"):
        make_rule("word")
    with pytest.raises(ValueError, match="bad regular expression"):
        make_rule("regex:move(")
    assert make_rule("regex:go\\(\\)").boundary("go()") == 4


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _letters(ids: Sequence[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def test_engine_suspends_where_the_text_says_and_keeps_the_greedy_answer(model: Any) -> None:
    # A random model writes no robot plans: here an "action" is any vowel.
    rule = make_rule("regex:[aeiouy]")
    r = random.Random(3)
    jobs = []
    for i in range(6):
        ids = tuple(r.randrange(256) for _ in range(r.randint(5, 30)))
        req = Request(rid=i, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=40)
        jobs.append(Job(req, 40))
    ex = EngineExecutor(make_policy("fcfs"), model, kv_capacity=10_000, offload_suspended=True)
    for j in jobs:
        ex.segmenters[j.request.rid] = TextSegmenter(rule, _letters)
    res = ex.run(jobs)
    prompts = [list(j.request.prompt_token_ids or ()) for j in jobs]
    ref = greedy_generate(model, prompts, 40)
    for k, (job, rec) in enumerate(zip(jobs, res.records, strict=True)):
        out = res.outputs[job.request.rid]
        assert out == ref[k]  # suspending at text boundaries changes no token
        offline = TextSegmenter(rule, _letters)
        cuts = sum(offline.add(t) is not None for t in out[:-1])  # not at the last token
        assert len(rec.segment_done) == cuts + 1
    assert sum(len(r.segment_done) for r in res.records) > len(jobs)  # boundaries happened
    assert ex.prefill_tokens == sum(len(p) for p in prompts)  # resumed without re-prefill
    assert ex.kv.total_tokens == 0


def test_server_segment_option_suspends_and_keeps_the_answer(monkeypatch: Any) -> None:
    import re

    import openai

    from duetime.engine import segment_stop
    from duetime.server.app import create_app
    from duetime.server.build import ServeOptions, build_state, load_served_model
    from duetime.server.threaded import serve_in_thread

    # The tiny model writes random bytes, which hold no sentences: let "sentence" mean
    # "every 4 characters" so the server path is exercised for sure.
    every4 = segment_stop.SegmentRule("sentence", re.compile(r"(?s).{4}"), lambda t: 0.01)
    monkeypatch.setitem(segment_stop.RULES, "sentence", lambda: every4)
    options = ServeOptions(model="tiny", predictor=None, kv_capacity=4096)
    served_model, codec, name = load_served_model(options)
    state = build_state(options, served_model, codec, name)
    ex = state.engine.executor
    calls: list[int] = []
    end_segment = ex.end_segment

    def spy(rid: int, gap: float = 0.0) -> bool:
        calls.append(rid)
        return end_segment(rid, gap)

    ex.end_segment = spy
    with serve_in_thread(create_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw: dict[str, Any] = {"model": name, "prompt": "Once upon a time", "max_tokens": 24}
        plain = client.completions.create(extra_body={"ignore_eos": True}, **kw)
        assert not calls
        seg = client.completions.create(
            extra_body={"ignore_eos": True, "segment": "sentence"}, **kw
        )
        assert len(calls) >= 2  # suspended at segment ends...
        assert seg.choices[0].text == plain.choices[0].text  # ...and resumed to the same answer
        with pytest.raises(openai.BadRequestError):
            client.completions.create(extra_body={"segment": "word"}, **kw)
    assert not ex.segmenters  # forgotten with the request
