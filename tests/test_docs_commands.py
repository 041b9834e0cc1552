"""The docs do not lie about the CLI: every `duetime ...` and `make ...` they quote still parses.

Command lines are taken from README.md, docs/*.md (shell code blocks, with
their ``\\`` continuations, and inline `` `duetime ...` `` spans) and the
Makefile's recipes, then parsed by the click command typer builds from the
real app: ``make_context`` walked through the sub-groups, exactly as
``duetime`` would parse them, but no command ever runs. Parsing checks that the
sub-command exists, that every option is one of that command's, that int,
float and choice values convert and sit in their range, that required options
are there and that nothing is left over. ``make X`` must name a Makefile rule.

One assertion lists every mismatch with file:line, so a rename is fixed in one go.
The extraction and the parsing live in tests/docs_quoted_commands.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_quoted_commands import Quote, all_quotes, markdown_quotes, mismatches

# ---------------------------------------------------------------- tests


def test_every_quoted_command_parses() -> None:
    quotes = all_quotes()
    assert sum(q.program == "duetime" for q in quotes) > 100, "the extractor found too few"
    assert any(q.program == "make" for q in quotes)
    bad = mismatches(quotes)
    assert not bad, f"{len(bad)} command line(s) in the docs do not parse:\n" + "\n".join(bad)


def _quotes_of(tmp_path: Path, text: str) -> list[Quote]:
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return list(markdown_quotes(doc))


def test_extracts_fences_continuations_and_inline_spans(tmp_path: Path) -> None:
    quotes = _quotes_of(
        tmp_path,
        "Run `duetime sim --rate 4` or\n`make demo`.\n\n"
        "```bash\n"
        ".venv/bin/duetime sweep --rates 4,8 \\\n"
        "    --seeds 0,1   # a comment --nope\n"
        "FOO=1 duetime serve --port 8001 &\n"
        "curl http://x | duetime nothing-here\n"
        "```\n"
        "```python\nduetime sim --nope\n```\n"
        "\n    duetime demo --out x \\\n        --rate 2   # an indented block\n"
        'PYTHONPATH=src python3 -c "from duetime.cli import app; app()" policies\n'
        "\n    make every step count (prose after no blank line? no: code)\n",
    )
    assert [(q.line, q.program, q.argv, q.mention) for q in quotes] == [
        (5, "duetime", ("sweep", "--rates", "4,8", "--seeds", "0,1"), False),
        (7, "duetime", ("serve", "--port", "8001"), False),
        (8, "duetime", ("nothing-here",), False),
        (14, "duetime", ("demo", "--out", "x", "--rate", "2"), False),
        (18, "make", ("every", "step", "count"), False),
        (1, "duetime", ("sim", "--rate", "4"), True),
        (2, "make", ("demo",), True),
    ]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("duetime sim --made-up-option 3", "--made-up-option"),
        ("duetime sim --requests many", "'--requests'"),
        ("duetime sim --requests 0", "greater than or equal to 1"),
        ("duetime serve --port 70000", "less than or equal to 65535"),
        ("duetime gateway --log-level loud", "loud"),
        ("duetime bench nope", "No such command 'nope'"),
        ("duetime advise batch --input-len 512 --output-len 128", "--deadline"),
        ("duetime sim --policy edf stray", "stray"),
        ("duetime serve --policy edff", "unknown policy edff"),
        ("duetime sweep --policies fcfs,nope,edf", "unknown policy nope"),
        ("make deploy", "deploy"),
        ("duetime predict train-length --seed s --epochs many", "'--epochs'"),
        ("duetime bench amin --engine [--reps 1|two]", "'--reps'"),
        ('python3 -c "from duetime.cli import app; app()" sim --nope', "--nope"),
    ],
)
def test_a_wrong_command_is_reported(tmp_path: Path, line: str, needle: str) -> None:
    bad = mismatches(_quotes_of(tmp_path, f"```\n{line}\n```\n"))
    assert len(bad) == 1, bad
    assert bad[0].startswith("doc.md:2: ")
    assert needle in bad[0]


@pytest.mark.parametrize(
    "line",
    [
        "duetime sim --policy NAME --rate 8 ...",
        "duetime bench amin [--requests 2000] --plot out/a.png",
        "duetime predict train-length --seed s --out m.npz",
        "duetime advise batch --input-len N --output-len <tokens> --deadline 10",
        "duetime bench amin --engine [--model gemma|tiny|x.gguf] [--clock cpu|wall]",
        "duetime predict --help",
        "duetime advise batch --help",
        "duetime load --max-requests 5 --requests 5 --deadline 10 --deadline interactive=2",
    ],
)
def test_placeholders_and_help_parse(tmp_path: Path, line: str) -> None:
    assert mismatches(_quotes_of(tmp_path, f"```\n{line}\n```\n")) == []


def test_inline_mentions_need_no_values_or_required_options(tmp_path: Path) -> None:
    text = "`duetime sim --predictor`, `duetime advise batch`, `duetime predict`\n"
    assert mismatches(_quotes_of(tmp_path, text)) == []
    assert len(mismatches(_quotes_of(tmp_path, "`duetime sim --nope`\n"))) == 1
