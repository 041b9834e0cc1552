"""Regression tests for bugs that ``tests/test_server_properties.py`` found in the server.

Each test is the smallest case that failed before its fix; the property test
is what finds the next one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from duetime.server.codec import ByteCodec, Detokenizer


def _utf8(ids: Sequence[int], *, final: bool) -> str:
    """The byte codec's text of ``ids``; with ``final=False`` a character still missing
    bytes is left out (a broken byte is U+FFFD either way)."""
    data = bytes(i - ByteCodec.OFFSET for i in ids if ByteCodec.OFFSET <= i < ByteCodec.vocab_size)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=final)


# Bytes that start, continue or break characters come up often among the ids.
_IDS = st.sampled_from([*range(3, 259), *(b + ByteCodec.OFFSET for b in (0xFF, 0xC3, 0xE2, 0x82))])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(_IDS, max_size=4), max_size=30))
def test_the_detokenizer_sends_every_final_character_and_never_changes_one(
    batches: list[list[int]],
) -> None:
    """A broken UTF-8 byte (one no later byte can complete) was held back like half a
    character, with everything after it, until a valid character came: a random answer
    of broken bytes streamed nothing until its end, and a stop string in it was found
    only then (the answer counted every token generated past it). The text before the
    last 3 tokens is final (a character spans at most 4 bytes) and must be out."""
    detok = Detokenizer(ByteCodec())
    ids: list[int] = []
    sent = ""
    for batch in batches:
        ids += batch
        sent += detok.add(batch)
        assert sent == detok.text
        assert sent.startswith(_utf8(ids[: max(0, len(ids) - 3)], final=False)), (ids, sent)
        assert _utf8(ids, final=True).startswith(sent), (ids, sent)
    sent += detok.flush()
    assert sent == _utf8(ids, final=True)
