"""Recover the complete elements of a JSON array that is truncated or damaged.

``json.load`` rejects the whole file when one byte is wrong, and the ShareGPT
file we ship is cut off mid-string. Here we decode the top-level array one
element at a time with :meth:`json.JSONDecoder.raw_decode`, which parses in
place (no copies of the 125 MB text). When an element fails to decode we look
for the next line that starts an element at the array's own indentation and go
on from there, so a damaged element in the middle costs only itself; if no such
line follows, the rest of the file was the truncated tail.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")


@dataclass(slots=True)
class RecoveryReport:
    """What :func:`iter_array` saw. ``truncated``: the array never closed (the usual case here)."""

    complete: int = 0
    damaged_regions: int = 0
    truncated: bool = False
    closed: bool = False


def _element_start(text: str, first: int) -> re.Pattern[str]:
    """Pattern for a line that opens an element at the indentation of the first element."""
    line_start = text.rfind("\n", 0, first) + 1
    indent = text[line_start:first]
    if line_start == 0 or indent.strip():  # first element shares a line: no layout to resync on
        return re.compile(r"(?!)")
    return re.compile("\n" + re.escape(indent) + r"(?=[{\[\"0-9tfn-])")


def _skip(text: str, pos: int) -> int:
    """Offset of the first non-whitespace character at or after ``pos``."""
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def iter_array(text: str, report: RecoveryReport | None = None) -> Iterator[tuple[Any, int, int]]:
    """Yield ``(element, start, end)`` for every complete element of the array in ``text``.

    ``start``/``end`` are character offsets of the element's JSON text. Counts
    go into ``report``. A trailing comma before ``]`` is tolerated. Raises
    ValueError if ``text`` does not start with ``[``.
    """
    report = report if report is not None else RecoveryReport()
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if not text.startswith("[", pos):
        raise ValueError("not a JSON array: the text does not start with '['")
    pos = _skip(text, pos + 1)
    resync = _element_start(text, pos)
    while True:
        if text.startswith("]", pos):
            report.closed = True
            return
        try:
            element, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            end = -1
        if end >= 0 and _skip(text, end) == len(text) and text[end - 1] not in '}]"':
            end = -1  # a number or literal at the very end may itself be cut short ("12" of "123")
        if end >= 0:
            report.complete += 1
            yield element, pos, end
            after = _skip(text, end)
            if text.startswith(",", after):
                pos = _skip(text, after + 1)
                continue
            if text.startswith("]", after):
                report.closed = True
                return
            if after == len(text):  # cut off right after this element
                report.truncated = True
                return
        # A damaged element, or junk after a good one: go on at the next element's line.
        found = resync.search(text, max(pos + 1, end))
        if found is None:  # nothing decodable follows: the file was cut off here
            report.truncated = True
            return
        report.damaged_regions += 1
        pos = found.end()
