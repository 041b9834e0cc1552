"""ShareGPT loading: pairing rule, recovery counts and caches, on a small file made here.

One slow test reads the real bundled file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from duetime.workloads import sharegpt
from duetime.workloads.sharegpt import later_pairs, load_sharegpt_lengths, read_pairs


class WordCounter:
    """A fake tokenizer: one token per whitespace-separated word. Counts its calls."""

    def __init__(self, identity: str = "words-v1") -> None:
        self.identity = identity
        self.texts_seen = 0

    def count(self, texts: Sequence[str], *, add_bos: bool = False) -> np.ndarray:
        self.texts_seen += len(texts)
        return np.array([len(t.split()) + add_bos for t in texts], dtype=np.int64)


def _turn(who: str, text: str) -> dict[str, str]:
    return {"from": who, "value": text}


CONVERSATIONS = [
    {"id": "ok_human_first", "conversations": [_turn("human", "a b c"), _turn("gpt", "d e")]},
    {  # the vLLM-style pair is the first human turn and the gpt turn after it
        "id": "ok_gpt_first",
        "conversations": [_turn("gpt", "hi"), _turn("human", "héllo wörld"), _turn("gpt", "ünï")],
    },
    {"id": "no_human", "conversations": [_turn("gpt", "x"), _turn("system", "y")]},
    {"id": "human_last", "conversations": [_turn("gpt", "x"), _turn("human", "y")]},
    {"id": "human_human", "conversations": [_turn("human", "x"), _turn("human", "y")]},
    {"id": "blank", "conversations": [_turn("human", "  "), _turn("gpt", "y")]},
    {"id": "broken", "conversations": "not a list"},
    {"id": "ok_last", "conversations": [_turn("human", "日本 語"), _turn("gpt", "1 2 3 4")]},
    {"id": "cut_off", "conversations": [_turn("human", "this one is trunc")]},
]


@pytest.fixture
def data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pretty-printed ShareGPT-like file cut inside its last conversation; a private cache."""
    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sharegpt, "_MEMORY", {})
    text = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("trunc") + 5], encoding="utf-8")
    return path


def test_pairs_and_skip_reasons(data_file: Path) -> None:
    lengths = load_sharegpt_lengths(data_file, counter=WordCounter(), progress=False)
    assert list(lengths.conv_id) == ["ok_human_first", "ok_gpt_first", "ok_last"]
    assert list(lengths.prompt_len) == [3 + 1, 2 + 1, 2 + 1]  # prompts count <bos>
    assert list(lengths.output_len) == [2, 1, 4]
    assert list(lengths.turn) == [0, 1, 0]
    s = lengths.stats
    assert (s.conversations, s.pairs, s.truncated_tail, s.damaged_regions) == (8, 3, 1, 0)
    assert (s.no_human_turn, s.no_gpt_reply, s.empty_text, s.not_a_conversation) == (1, 2, 1, 1)
    assert s.skipped == 5
    assert "skipped 5" in s.summary()
    assert "incomplete tail 1" in s.summary()


def test_read_pairs_seeks_to_non_ascii_conversations(data_file: Path) -> None:
    lengths = load_sharegpt_lengths(data_file, counter=WordCounter(), progress=False)
    assert read_pairs(lengths, [2, 1]) == [("日本 語", "1 2 3 4"), ("héllo wörld", "ünï")]


def test_second_load_comes_from_disk_without_tokenizing(
    data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = WordCounter()
    built = load_sharegpt_lengths(data_file, counter=first, progress=False)
    assert first.texts_seen == 6
    assert not built.from_cache
    assert load_sharegpt_lengths(data_file, counter=first, progress=False) is built  # in process

    monkeypatch.setattr(sharegpt, "_MEMORY", {})  # as if in a new process
    again = WordCounter()
    cached = load_sharegpt_lengths(data_file, counter=again, progress=False)
    assert again.texts_seen == 0
    assert cached.from_cache
    assert np.array_equal(cached.prompt_len, built.prompt_len)
    assert list(cached.conv_id) == list(built.conv_id)
    assert cached.stats == built.stats


def test_cache_is_keyed_by_counter_and_file_change(data_file: Path) -> None:
    load_sharegpt_lengths(data_file, counter=WordCounter(), progress=False)
    other = WordCounter(identity="words-v2")
    load_sharegpt_lengths(data_file, counter=other, progress=False)
    assert other.texts_seen == 6  # another tokenizer never reuses counts

    st = data_file.stat()
    os.utime(data_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file "changed"
    touched = WordCounter()
    assert not load_sharegpt_lengths(data_file, counter=touched, progress=False).from_cache
    assert touched.texts_seen == 6


def test_corrupt_cache_file_is_rebuilt(data_file: Path) -> None:
    load_sharegpt_lengths(data_file, counter=WordCounter(), progress=False)
    (cache_file,) = (data_file.parent / "cache").glob("sharegpt-lengths-*.npz")
    cache_file.write_bytes(b"garbage")
    sharegpt._MEMORY.clear()
    counter = WordCounter()
    assert len(load_sharegpt_lengths(data_file, counter=counter, progress=False)) == 3
    assert counter.texts_seen == 6


@pytest.mark.slow
def test_real_bundled_file_recovers_conversations_and_reports_skips() -> None:
    lengths = load_sharegpt_lengths(progress=False)
    s = lengths.stats
    # The bundled file is the first 125 MB of ShareGPT V3: 17,671 complete conversations.
    assert s.conversations > 17_000
    assert s.truncated_tail == 1
    assert s.skipped > 0
    assert s.pairs == len(lengths) == s.conversations - s.skipped
    assert lengths.prompt_len.min() >= 2
    assert lengths.output_len.min() >= 1
    prompt, _answer = read_pairs(lengths, [0])[0]
    assert prompt.startswith("Summarize the main ideas of Jeff Walker")


def test_later_pairs_are_the_human_gpt_pairs_after_the_kept_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUETIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sharegpt, "_MEMORY", {})
    turns = [("gpt", "hi"), ("human", "p1"), ("gpt", "a1"), ("human", "p2"), ("gpt", "a2"),
             ("human", "  "), ("gpt", "blank prompt"), ("human", "p3"), ("human", "p4 é"),
             ("gpt", "a4"), ("system", "s"), ("gpt", "after"), ("human", "last")]  # fmt: skip
    convs = [
        {"id": "single", "conversations": [_turn("human", "q"), _turn("gpt", "r")]},
        {"id": "multi", "conversations": [_turn(w, t) for w, t in turns]},
    ]
    path = tmp_path / "multi.json"
    path.write_text(json.dumps(convs, ensure_ascii=False), encoding="utf-8")
    lengths = load_sharegpt_lengths(path, counter=WordCounter(), progress=False)
    assert list(lengths.turn) == [0, 1]
    assert later_pairs(lengths, [0, 1]) == [(1, "p2", "a2"), (1, "p4 é", "a4")]
    assert later_pairs(lengths, [0]) == []
