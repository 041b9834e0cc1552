"""Text stop checkers for segmented generation (TimelyLLM §4.1, §5, §7.4.2).

Source: ``../shared/seeds/timelyllm.txt``. TimelyLLM detokenizes as it
generates and suspends a request as soon as the text holds a complete
executable robot action ("regular expression matching to detect whether a
robot action appears", e.g. ``pick([obj],{})``); for chatbot text it cuts at
sentence or paragraph ends and gives the reader time at 300 words per minute
before the next segment is due.

A :class:`SegmentRule` is a regex whose match end is the segment boundary
plus ``gap``, the seconds the client needs with the finished segment (the
robot's execution time, the reading time). A :class:`TextSegmenter` applies
one rule to one request's generated ids; the engine executor calls
:meth:`TextSegmenter.add` for every new token and ends the segment
(:meth:`ExecutorCore.end_segment`) when it returns a gap. A boundary can only
fall at a token end: text of the boundary token past the match is carried
into the next segment's text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

READ_WPM = 300.0  # §7.4.2: average adult reading speed

# One executable statement per line, optionally numbered or bulleted:
# ``name(args)`` closed and followed by ``;`` or a newline, or an ``ACTION: ...`` line.
ACTION_RE = (
    r"(?m)^[ \t]*(?:\d+[.)][ \t]*|[-*][ \t]*)?"  # line start, optional "1." / "-"
    r"(?:ACTION:[^\n]*\S[^\n]*\n"  # ACTION: <something>, newline
    r"|[A-Za-z_][\w.]*\([^()\n]*\)[ \t]*[;\n])"  # name(args) then ; or newline
)
# End punctuation (and closing quotes/brackets), confirmed by the whitespace after it:
# "3.14" and "e.g.x" do not cut, "Done. Next" does.
SENTENCE_RE = r"[.!?…][\"'”’)\]]*(?=\s)"
PARAGRAPH_RE = r"\S[^\n]*\n[ \t]*\n"


def reading_time_s(text: str, wpm: float = READ_WPM) -> float:
    """Seconds a reader needs for ``text`` at ``wpm`` words per minute."""
    return len(text.split()) * 60.0 / wpm


def _no_gap(text: str) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class SegmentRule:
    """Where a segment of generated text ends, and the client's time with it.

    ``gap(segment_text)`` is in seconds: when the executor expects the client
    to want the next segment (robot execution time, reading time).
    """

    name: str
    pattern: re.Pattern[str]
    gap: Callable[[str], float] = _no_gap

    def boundary(self, text: str) -> int | None:
        """Index just past the first segment boundary in ``text``, or None."""
        m = self.pattern.search(text)
        return m.end() if m is not None and m.end() > 0 else None


def robot_action(
    regex: str = ACTION_RE, exec_time: Callable[[str], float] = _no_gap
) -> SegmentRule:
    """A segment per executable action; ``exec_time`` is the robot's time model for it."""
    return SegmentRule("action", re.compile(regex), exec_time)


def sentence(wpm: float = READ_WPM) -> SegmentRule:
    """A segment per sentence, due after its reading time (TimelyLLM-Sen)."""
    return SegmentRule("sentence", re.compile(SENTENCE_RE), lambda t: reading_time_s(t, wpm))


def paragraph(wpm: float = READ_WPM) -> SegmentRule:
    """A segment per paragraph (a blank line), due after its reading time (TimelyLLM-Para)."""
    return SegmentRule("paragraph", re.compile(PARAGRAPH_RE), lambda t: reading_time_s(t, wpm))


RULES: dict[str, Callable[[], SegmentRule]] = {
    "action": robot_action,
    "sentence": sentence,
    "paragraph": paragraph,
}


def make_rule(spec: str) -> SegmentRule:
    """``action``, ``sentence``, ``paragraph`` or ``regex:PATTERN`` (an action regex)."""
    if spec in RULES:
        return RULES[spec]()
    if spec.startswith("regex:"):
        try:
            return robot_action(spec.removeprefix("regex:"))
        except re.error as e:
            raise ValueError(f"segment rule {spec!r}: bad regular expression ({e})") from None
    raise ValueError(
        f"unknown segment rule {spec!r}: use one of {', '.join(RULES)} or regex:PATTERN"
    )


@dataclass(slots=True)
class TextSegmenter:
    """One request's stop checker: feed it generated ids, it says when a segment ended."""

    rule: SegmentRule
    decode: Callable[[Sequence[int]], str]
    ids: list[int] = field(default_factory=list)
    carry: str = ""  # text of the boundary token past the boundary
    segments: list[str] = field(default_factory=list)  # finished segments' text
    held: int = 0  # tokens waited for a half character to complete

    #: A UTF-8 character spans at most 4 bytes: after that many tokens a trailing
    #: U+FFFD is a broken byte, not a half character, and is checked as text.
    MAX_HOLD = 4

    def add(self, token_id: int) -> float | None:
        """Append one generated id; the client's gap (s) if a segment just ended, else None."""
        self.ids.append(token_id)
        text = self.carry + self.decode(self.ids)
        if text.endswith("\ufffd") and self.held < self.MAX_HOLD:
            self.held += 1
            return None  # half a character: wait for the next token
        self.held = 0
        end = self.rule.boundary(text)
        if end is None:
            return None
        seg = text[:end]
        self.segments.append(seg)
        self.carry, self.ids = text[end:], []
        return self.rule.gap(seg)

    def reset(self) -> None:
        """The answer was discarded (a restart): start over."""
        self.ids, self.carry, self.segments, self.held = [], "", [], 0
