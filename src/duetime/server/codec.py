"""Text ↔ token ids for the server, and incremental detokenization for streams.

Two codecs: the Gemma tokenizer read from the GGUF (the real model) and a
byte codec (one token per UTF-8 byte) for the tiny random-weight models the
tests serve. A stream must never emit half a UTF-8 character or a piece the
tokenizer would later merge differently, so :class:`Detokenizer` re-decodes
a short window and holds text back while it ends in U+FFFD — the approach
vLLM and TGI take — but for 3 tokens at most: a byte no later one can complete
is sent as U+FFFD, not held (with all text after it) until the answer ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ByteCodec", "Codec", "Detokenizer", "GemmaCodec"]


class Codec(Protocol):
    """What the server needs of a tokenizer."""

    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, with BOS first where the model wants it."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens dropped)."""
        ...

    def guidance_tokenizer(self) -> Any:
        """llguidance's ``LLTokenizer`` over this vocabulary (structured outputs' masks;
        built on first use: seconds for a large vocabulary)."""
        ...


class GemmaCodec:
    """Gemma 3's tokenizer from the packaged GGUF (adds ``<bos>``)."""

    def __init__(self) -> None:
        from duetime.tokenizer import load_gemma_tokenizer

        self._tok = load_gemma_tokenizer()
        self.bos_id = self._tok.token_to_id("<bos>")
        self.eos_id = self._tok.token_to_id("<eos>")

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): a 1 MB prompt tokenized on a
        # worker thread then stalls neither the event loop nor the engine thread (~0.3 s).
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def guidance_tokenizer(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self._tok.to_str(), eos_token=self.eos_id)


class ByteCodec:
    """One token per UTF-8 byte, shifted past the special ids (0 pad, 1 eos, 2 bos).

    Vocabulary size 259; pair it with a random model of at least that vocabulary.
    """

    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self) -> None:
        self.bos_id: int | None = 2
        self.eos_id: int | None = 1

    def encode(self, text: str) -> list[int]:
        return [2, *(b + self.OFFSET for b in text.encode("utf-8"))]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def guidance_tokenizer(self) -> Any:
        import llguidance

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(self)))


class _ByteVocab:
    """The byte codec as llguidance's ``TokenizerWrapper`` wants a tokenizer: each id's
    bytes, the special ids, and encoding without BOS."""

    def __init__(self, codec: ByteCodec) -> None:
        self.eos_token_id = codec.eos_id
        self.bos_token_id = codec.bos_id
        self.special_token_ids = list(range(codec.OFFSET))
        names = [b"<pad>", b"<eos>", b"<bos>"]
        self.tokens = names + [bytes([b]) for b in range(256)]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return [b + ByteCodec.OFFSET for b in data]


class Detokenizer:
    """Turns a growing list of generated ids into text deltas that are safe to send."""

    #: How many already-sent tokens are re-decoded with each new one (context for merges).
    WINDOW = 6
    #: A character spans at most 4 bytes, so at most 3 tokens follow its first one: the
    #: text of all but the last HOLD tokens is final even where it ends in U+FFFD.
    HOLD = 3

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.text = ""  # everything sent so far
        self._prefix = 0  # ids[:_prefix] are settled; their text is text[:_prefix_chars]
        self._prefix_chars = 0
        #: Where each id added by :meth:`add_each` ends in ``text`` (its string is the
        #: piece since the one before): what a token's log-probability entry shows.
        self.ends: list[int] = []
        #: Text of the ids so far not in ``text`` yet (half a character, or what a broken
        #: byte holds back): :meth:`flush` would hand it to the newest id.
        self.holding = False

    def add_each(self, new_ids: Sequence[int]) -> None:
        """Append ids one at a time, noting in :attr:`ends` where each one's text ends
        (a token whose text is held back ends where the one before it did)."""
        for tok in new_ids:
            self.add([tok])
            self.ends.append(len(self.text))

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the new text that can be sent now (may be empty)."""
        self.ids.extend(new_ids)
        start = max(0, self._prefix)
        window = raw = self.codec.decode(self.ids[start:])
        if window.endswith("\ufffd"):
            # Half a character (wait for the next token), or a broken byte no token will
            # mend: waiting for a valid character held back everything after it, up to
            # the whole answer (and a stop string in it). The last HOLD tokens wait.
            done = self.codec.decode(self.ids[start : max(start, len(self.ids) - self.HOLD)])
            while not window.startswith(done) and done.endswith("\ufffd"):
                done = done[:-1]  # the cut split a character the window has whole
            window = done if window.startswith(done) else ""
        full = self.text[: self._prefix_chars] + window
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        self.holding = self.text != self.text[: self._prefix_chars] + raw
        if len(self.ids) - self._prefix > self.WINDOW:
            # Settle all but the last WINDOW tokens; their text will not change any more.
            # Text ending in U+FFFD settles only where the cut leaves the window's text
            # whole: a broken byte is then final (more than HOLD tokens follow it), while
            # half a character, or one U+FFFD standing for two broken bytes, does not split
            # cleanly. Refusing every U+FFFD re-decoded a run of broken bytes from its start
            # with each token: quadratic in its length.
            settle = len(self.ids) - self.WINDOW
            settled_text = self.codec.decode(self.ids[start:settle])
            clean = not settled_text.endswith("\ufffd") or (
                raw == settled_text + self.codec.decode(self.ids[settle:])
            )
            if clean and full.startswith(self.text[: self._prefix_chars] + settled_text):
                self._prefix_chars += len(settled_text)
                self._prefix = settle
        return delta

    def flush(self) -> str:
        """Text held back at the end of the answer (an incomplete character becomes U+FFFD)."""
        full = self.text[: self._prefix_chars] + self.codec.decode(self.ids[self._prefix :])
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.holding = False
        if self.ends:  # text held back at the end is the last token's
            self.ends[-1] = len(self.text)
        return delta
