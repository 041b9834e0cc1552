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
decoding. JSON has no -Infinity: a log-probability under -9999 is reported as
-9999, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duetime.engine.logprobs import TokenLogprob
from duetime.server.codec import Codec

__all__ = ["FLOOR", "LoggedToken", "chat_logprobs", "completion_logprobs"]

FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class LoggedToken:
    """One answer token as the client sees it: the engine's entry, its text, where it starts."""

    entry: TokenLogprob
    text: str
    offset: int


def _lp(v: float) -> float:
    return max(v, FLOOR)


def completion_logprobs(tokens: Sequence[LoggedToken], codec: Codec) -> dict[str, Any]:
    """``/v1/completions``' object for ``tokens``."""
    tops = []
    for t in tokens:
        top: dict[str, float] = {}
        for i, v in t.entry.top:  # likeliest first: a string two tokens share keeps the first
            top.setdefault(codec.decode([i]), _lp(v))
        top.setdefault(t.text, _lp(t.entry.logprob))
        tops.append(top)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [_lp(t.entry.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": [t.offset for t in tokens],
    }


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
