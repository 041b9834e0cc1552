"""Every link in README.md and docs/ lands: the file exists, and an anchor names a row or
a heading of the page it points into. Every module, source file and test file the pages
name in code spans (`duetime.server.step_timer`, `server/step_timer.py`,
`tests/test_server_*.py`) exists.

The README's figures point to rows of docs/results.md (``results.md#<id>``), in
Markdown links and in plain text (code comments of the README's command list); a row
renamed or dropped would leave a figure pointing nowhere, which no reader reports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_MENTION = re.compile(r"results\.md#([\w-]+)")
ROW_ANCHOR = re.compile(r'<a id="([^"]+)"')
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
PACKAGES = "|".join(
    sorted(d.name for d in (ROOT / "src" / "duetime").iterdir() if (d / "__init__.py").exists())
)
# `tests/test_x.py`, or a family of them: `tests/test_server_*.py`.
TEST_PATH = re.compile(r"`(tests/[\w*]+\.py)`")
SOURCE_PATH = re.compile(
    rf"`((?:src/)?duetime/[\w/]+\.(?:py|cpp|h)|(?:{PACKAGES})/[\w/]+\.(?:py|cpp|h))`"
)
# `duetime.<package>...`: `duetime.ttft_ms` and the like are fields of an answer's JSON.
MODULE = re.compile(rf"`(duetime\.(?:{PACKAGES})(?:\.\w+)*)`")


def _pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` dropped, each
    space a ``-`` (``The lengths (`--x`)`` -> ``the-lengths---x``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page offers: its ``<a id>`` rows and its headings."""
    text = page.read_text(encoding="utf-8")
    return set(ROW_ANCHOR.findall(text)) | {heading_slug(h) for h in HEADING.findall(text)}


def broken_links(root: Path) -> list[str]:
    """``page: link (why)`` for each link of README.md and docs/*.md that lands nowhere."""
    offered: dict[Path, set[str]] = {}
    bad = []
    results = root / "docs" / "results.md"
    for page in _pages(root):
        text = page.read_text(encoding="utf-8")
        for link in LINK.findall(text):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (page.parent / path).resolve() if path else page.resolve()
            if not target.exists():
                bad.append(f"{page.relative_to(root)}: {link} (no such file)")
            elif fragment and target.suffix == ".md":
                if target not in offered:
                    offered[target] = anchors(target)
                if fragment not in offered[target]:
                    bad.append(f"{page.relative_to(root)}: {link} (no such anchor)")
        if results.exists():
            rows = offered.setdefault(results.resolve(), anchors(results))
            for row in RESULTS_MENTION.findall(LINK.sub("]", text)):  # links: checked above
                if row not in rows:
                    bad.append(f"{page.relative_to(root)}: results.md#{row} (no such row)")
    return bad


def _module_exists(src: Path, dotted: str) -> bool:
    """``duetime.a.b`` names a module, or a name a module defines (``duetime.a.Cls``)."""
    parts = dotted.split(".")
    base = src.joinpath(*parts)
    if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
        return True
    owner = src.joinpath(*parts[:-1])
    for file in (owner.with_suffix(".py"), owner / "__init__.py"):
        if file.exists() and re.search(rf"\b{parts[-1]}\b", file.read_text(encoding="utf-8")):
            return True
    return False


def missing_code(root: Path) -> list[str]:
    """``page: name`` for each module, source file or test file a page names that is not
    in the tree."""
    src, bad = root / "src", []
    for page in _pages(root):
        text = page.read_text(encoding="utf-8")
        for path in SOURCE_PATH.findall(text):
            rel = path.removeprefix("src/")
            if not ((src / rel).exists() or (src / "duetime" / rel).exists()):
                bad.append(f"{page.relative_to(root)}: {path}")
        bad += [
            f"{page.relative_to(root)}: {m}"
            for m in MODULE.findall(text)
            if not _module_exists(src, m)
        ]
        bad += [
            f"{page.relative_to(root)}: {t}"
            for t in TEST_PATH.findall(text)
            if not any(root.glob(t))
        ]
    return bad


def test_every_link_in_the_docs_lands() -> None:
    bad = broken_links(ROOT)
    assert not bad, "links that land nowhere:\n" + "\n".join(bad)


def test_every_module_and_source_file_the_docs_name_exists() -> None:
    bad = missing_code(ROOT)
    assert not bad, "names of code that is not there:\n" + "\n".join(bad)


def test_a_renamed_module_is_named(tmp_path: Path) -> None:
    tree = _tree(
        tmp_path, "`duetime.core.cost` `duetime.core.cost.LinearStepCost` `core/cost.py`\n"
    )
    (tmp_path / "src" / "duetime" / "core").mkdir(parents=True)
    (tmp_path / "src" / "duetime" / "core" / "__init__.py").write_text("")
    (tmp_path / "src" / "duetime" / "core" / "cost.py").write_text("class LinearStepCost: ...\n")
    assert missing_code(tree) == []
    (tmp_path / "README.md").write_text(
        "`duetime.core.costs` `server/gone.py` `tests/test_x*.py`\n"
    )
    assert missing_code(tree) == [
        "README.md: server/gone.py",
        "README.md: duetime.core.costs",
        "README.md: tests/test_x*.py",
    ]


def test_the_readme_points_into_the_results_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(RESULTS_MENTION.findall(readme)) >= 5


def _tree(tmp_path: Path, readme: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(
        '# Results\n\n## Serving\n\n| <a id="serve-peers"></a>serve-peers | 1.5x |\n'
    )
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


@pytest.mark.parametrize(
    ("readme", "why"),
    [
        ("[x](docs/results.md#serve-peer)", "no such anchor"),
        ("[x](docs/missing.md)", "no such file"),
        ("run it  # 1.5x: docs/results.md#serve-peerz", "no such row"),
    ],
)
def test_a_link_that_lands_nowhere_is_named(tmp_path: Path, readme: str, why: str) -> None:
    bad = broken_links(_tree(tmp_path, readme))
    assert len(bad) == 1, bad
    assert why in bad[0]
    assert bad[0].startswith("README.md: ")


def test_rows_headings_and_plain_mentions_that_land_pass(tmp_path: Path) -> None:
    readme = (
        "[a](docs/results.md#serve-peers) [b](docs/results.md#serving) "
        "[c](#readme) see docs/results.md#serve-peers [d](https://example.com/x#y)\n# README\n"
    )
    assert broken_links(_tree(tmp_path, readme)) == []
    assert heading_slug("The lengths (`--length-window`)") == "the-lengths---length-window"
