"""Regression tests for bugs that ``tests/test_server_properties.py`` found in the
server's detokenizer: the text a stream sends as token ids come in.

Each test is the smallest case that failed before its fix; the property test
is what finds the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from duetime.server.codec import ByteCodec, Detokenizer
from tests.factories import byte_codec_text

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
        assert sent.startswith(byte_codec_text(ids[: max(0, len(ids) - 3)], final=False)), (
            ids,
            sent,
        )
        assert byte_codec_text(ids, final=True).startswith(sent), (ids, sent)
    sent += detok.flush()
    assert sent == byte_codec_text(ids, final=True)


class _CountingCodec(ByteCodec):
    """The byte codec, counting the ids it is asked to decode."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_the_detokenizer_decodes_a_run_of_broken_bytes_in_linear_work() -> None:
    """Text ending in U+FFFD was never settled, so a run of broken bytes (a random model
    writes them) was re-decoded from its start with every token: 1,000 of them, then 500
    characters, cost 1.5 million decoded ids. The window's decode shows a broken byte is
    final after more than HOLD tokens, so the settled prefix moves on and each token costs
    a few ids."""
    codec = _CountingCodec()
    detok = Detokenizer(codec)
    broken, a_grave = [0xFF + ByteCodec.OFFSET], [0xC3 + ByteCodec.OFFSET, 0x80 + ByteCodec.OFFSET]
    ids = broken * 1000 + a_grave * 500
    sent = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert sent == byte_codec_text(ids, final=True)
    assert codec.decoded < 40 * len(ids), codec.decoded
