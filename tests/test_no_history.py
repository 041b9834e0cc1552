"""No history in the tree: no "session" followed by a number in src/, tests/ or docs/,
no output folder named after one (``out/s24/``), and none of the phrases that tell a
run's place in a diary ("the day before", "since replaced"), and no number of the
project's own issue tracker, which lives outside the tree ("issue #7").

Such a mark says when something changed, which only git should hold; a reader
cannot tell what it refers to. Comments, option help, variant names and docs
say what is, and why, with the figure that decided it; a result names the code,
the date and the machine it ran on. This file spells the marks it looks for,
so it is the one file not read.
"""

from __future__ import annotations

import re
from pathlib import Path

THIS = Path(__file__).resolve()
ROOT = THIS.parent.parent
TREES = ("src", "tests", "docs")
WORD = "sess" + "ion"
DIARY = ("previous day", "day before", "an hour earlier", "since replaced", "at that commit",
         "before this change", "as it was then")  # fmt: skip
HISTORY = re.compile(
    "|".join(
        [WORD + r"s? [0-9]", r"\bout/s[0-9]+/", r"\bissues? #[0-9]", *(re.escape(p) for p in DIARY)]
    ),
    re.IGNORECASE,
)


def _text_files() -> list[Path]:
    """Every file under the checked trees that reads as UTF-8 text (images etc. skipped)."""
    files = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path != THIS:
                files.append(path)
    return files


def _hits(text: str) -> list[int]:
    """Line numbers (from 1) whose text carries a history mark."""
    return [n for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_pattern_catches_marks_and_spares_plain_use() -> None:
    marks = [f"{WORD} 12", f"(before {WORD.capitalize()} 3)", f"{WORD}s 2-4", f"{WORD.upper()} 30"]
    marks += ["`out/s24/adm.json`", "on older code the Day Before", "a fit since replaced"]
    marks += ["Targets (issue #7):", "see Issues #41-#44"]
    plain = [f"a {WORD}-scoped fixture", f"one {WORD} per client", f"{WORD}_id 7"]
    plain += ["out/serve-peers/table.md", "layout/s2/x", "the day's first run"]
    assert all(_hits(m) == [1] for m in marks)
    assert not any(_hits(p) for p in plain)


def test_no_history_marks_in_the_tree() -> None:
    found = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}" for n in _hits(text)]
    assert not found, "history marks (git holds history); say what is:\n" + "\n".join(found)
