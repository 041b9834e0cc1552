"""A choice's ``logprobs`` object, in the shape each OpenAI endpoint uses.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
where ``top_logprobs[i]`` maps the N likeliest tokens (and the chosen one, as
vLLM does) to their log-probabilities; where two tokens decode to the same
string (bytes of a character: U+FFFD) the likelier one keeps it. Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A chosen token's string is its piece of the answer, so the pieces concatenate
to the text the client got: a token holding the first bytes of a character has
"" and the one completing it the whole character, and the token a stop string
cuts keeps only what precedes the cut. An alternative's string is its own
decoding. With ``echo`` a completion's object begins with the prompt's tokens
(the first without a log-probability), its answer's offsets counted after the
echoed text. JSON has no -Infinity: a log-probability under -9999 is reported as
-9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duetime.engine.logprobs import TokenLogprob
from duetime.server.codec import Codec, Detokenizer

__all__ = [
    "FLOOR",
    "LoggedToken",
    "chat_logprobs",
    "completion_logprobs",
    "joined",
    "prompt_logprobs",
]

FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class LoggedToken:
    """One answer token as the client sees it: the engine's entry, its text, where it starts."""

    entry: TokenLogprob
    text: str
    offset: int


def _lp(v: float) -> float:
    return max(v, FLOOR)


def _completion_top(entry: TokenLogprob, text: str, codec: Codec) -> dict[str, float]:
    top: dict[str, float] = {}
    for i, v in entry.top:  # likeliest first: a string two tokens share keeps the first
        top.setdefault(codec.decode([i]), _lp(v))
    top.setdefault(text, _lp(entry.logprob))
    return top


def completion_logprobs(
    tokens: Sequence[LoggedToken], codec: Codec, *, shift: int = 0
) -> dict[str, Any]:
    """``/v1/completions``' object for ``tokens``; ``shift`` moves their text offsets
    (past an echoed prompt)."""
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [_lp(t.entry.logprob) for t in tokens],
        "top_logprobs": [_completion_top(t.entry, t.text, codec) for t in tokens],
        "text_offset": [t.offset + shift for t in tokens],
    }


def prompt_logprobs(
    ids: Sequence[int], entries: Sequence[TokenLogprob], codec: Codec
) -> dict[str, Any]:
    """The echoed prompt's part of a ``/v1/completions`` object: one position per prompt
    token, its string its piece of the decoded prompt (as an answer token's), its
    log-probability ``entries[i - 1]`` (:class:`~duetime.engine.logprobs.LogprobLog`'s
    ``prompt_entries``). The first token has none (nothing comes before it), null as in
    OpenAI's and vLLM's answers; so has any the prefill did not reach (an answer that
    ended before its first token)."""
    detok = Detokenizer(codec)
    detok.add_each(ids)
    detok.flush()
    text, ends = detok.text, detok.ends
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    out: dict[str, list[Any]] = {key: [] for key in keys}
    for i in range(len(ids)):
        start = ends[i - 1] if i else 0
        piece = text[start : ends[i]]
        entry = entries[i - 1] if 0 < i <= len(entries) else None
        out["tokens"].append(piece)
        out["token_logprobs"].append(None if entry is None else _lp(entry.logprob))
        out["top_logprobs"].append(None if entry is None else _completion_top(entry, piece, codec))
        out["text_offset"].append(start)
    return out


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two ``/v1/completions`` objects one after the other (the prompt's, the answer's)."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(tokens: Sequence[LoggedToken], codec: Codec) -> dict[str, Any]:
    """``/v1/chat/completions``' object for ``tokens``."""

    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **one(t.text, t.entry.logprob),
                "top_logprobs": [one(codec.decode([i]), v) for i, v in t.entry.top],
            }
            for t in tokens
        ]
    }
