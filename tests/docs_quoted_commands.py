"""Find the command lines the docs quote, and say why one would not parse, for
tests/test_docs_commands.py.

:func:`all_quotes` gathers each `duetime ...` and `make ...` call from README.md,
docs/*.md (shell code blocks, with their ``\\`` continuations, and inline
`` `duetime ...` `` spans) and the Makefile's recipes, as :class:`Quote`;
:func:`markdown_quotes` does it for one Markdown file. :func:`mismatches` parses each
with the click command typer builds from the real app (:func:`cli`, through
:func:`parse_error`), running no command, and checks that ``make X`` names a Makefile
rule (:func:`make_targets`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import typer.main
from typer._click.exceptions import (
    BadOptionUsage,
    BadParameter,
    MissingParameter,
    NoArgsIsHelpError,
)

from duetime.cli import app
from duetime.cli.common import _log_level, _print_version, gamma_cv, open_share, positive_rate
from duetime.cli.paths import input_list, input_path, output_path
from duetime.cli.sim import _demo_outputs
from duetime.policies.registry import available_policies

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAKEFILE = ROOT / "Makefile"
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}  # ```python / ```json quote no shell

# Parsing runs option callbacks. These only check a value, so they run: a bad
# --log-level in the docs is caught like a bad --port.
_PURE_CALLBACKS: set[Any] = {
    *(_log_level, positive_rate, gamma_cv, open_share),
    *(input_path, input_list),
}
# These touch the machine (``output_path`` tries a file beside a --json path) or end
# the run (``--version``), so they are dropped: whether out/ is writable here says
# nothing about the docs.
_SKIPPED_CALLBACKS: set[Any] = {output_path, _demo_outputs, _print_version}


@dataclass(frozen=True, slots=True)
class Quote:
    """One command line quoted in a file. ``mention``: an inline span naming a
    command or an option in prose (`duetime sim --predictor`), where a missing
    required option or a last option without its value is not a mistake."""

    file: Path
    line: int
    program: str  # "duetime" or "make"
    argv: tuple[str, ...]
    mention: bool

    def where(self) -> str:
        name = self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file.name
        return f"{name}:{self.line}: {self.program} {shlex.join(self.argv)}"


# ---------------------------------------------------------------- extraction

_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_OPTIONAL = re.compile(r"\[(--?[A-Za-z][^\[\]]*)\]")  # usage-style [--requests 2000]
_ALTERNATIVES = re.compile(r"(?<!\S)[^\s|'\"]+(?:\|[^\s|'\"]+)+(?!\S)")  # gemma|tiny
_SHELL_OPS = set("();<>|&")
_ANGLED = re.compile(r"<(\w[\w-]*)>")  # a <placeholder>, which the shell would read as `<` + `>`
# `python3 -c "from duetime.cli import app; app()" predict ...` runs duetime from src/
_PYTHON_APP = re.compile(r"^(\S*/)?python3?$")


def _variants(text: str) -> list[str]:
    """A usage line with `a|b|c` choices (no spaces: a shell pipe has them) once per
    choice, the i-th line taking the i-th alternative everywhere (the last when fewer)."""
    groups = [m.group(0).split("|") for m in _ALTERNATIVES.finditer(text)]
    if not groups:
        return [text]
    between = _ALTERNATIVES.split(text)
    out = []
    for i in range(max(len(g) for g in groups)):
        chosen = [g[min(i, len(g) - 1)] for g in groups]
        out.append("".join(a + b for a, b in zip(between, [*chosen, ""], strict=True)))
    return out


def _commands(text: str) -> Iterator[tuple[str, list[str]]]:
    """(program, argv) of each `duetime` / `make` call in a shell line; comments,
    redirections and `&&`/`|`/`&` tails are cut off, as the shell would."""
    text = _ANGLED.sub(lambda m: m.group(1).upper().replace("-", "_"), _OPTIONAL.sub(r"\1", text))
    for variant in _variants(text):
        lex = shlex.shlex(variant, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        try:
            tokens = list(lex)
        except ValueError:  # an unbalanced quote: prose, not a command line
            return
        segment: list[str] = []
        for tok in [*tokens, ";"]:
            if not (tok and set(tok) <= _SHELL_OPS):
                segment.append(tok)
                continue
            while segment and (segment[0] in ("$", "time") or re.match(r"^\w+=", segment[0])):
                segment.pop(0)  # a prompt, `time`, an environment variable set for the call
            if segment and (segment[0] == "duetime" or segment[0].endswith("/duetime")):
                yield "duetime", segment[1:]
            elif segment and segment[0] == "make":
                yield "make", segment[1:]
            elif (
                len(segment) > 2
                and _PYTHON_APP.match(segment[0])
                and segment[1] == "-c"
                and "from duetime.cli import app" in segment[2]
            ):
                yield "duetime", segment[3:]
            segment = []


def markdown_quotes(path: Path) -> Iterator[Quote]:
    lines = path.read_text(encoding="utf-8").splitlines()
    fence: str | None = None  # the fence's marker while inside a code block
    shell = code = False  # in a shell fence; in an indented code block
    prose: list[tuple[int, str]] = []  # (line number, text) outside code blocks
    pending: list[str] = []  # a fenced command continued with a backslash
    start = 0
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w-]*)", line)
        if fence is None and m:
            fence, shell = m.group(1), m.group(2).lower() in SHELL_FENCES
            continue
        if fence is not None and line.strip().startswith(fence):
            fence = None
            continue
        if fence is None:
            # An indented code block: four spaces after a blank line, or more of the block.
            indented = line.startswith("    ") and (code or n == 1 or not lines[n - 2].strip())
            code = indented or (code and not line.strip())
            if not indented:
                prose.append((n, line))
                continue
        elif not shell:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        for program, argv in _commands(" ".join([*pending, line])):
            yield Quote(path, start, program, tuple(argv), mention=False)
        pending = []
    # Inline spans may wrap over a line break, never over a blank line.
    text = "\n".join(t for _, t in prose)
    numbers = [n for n, _ in prose]
    for m in _INLINE.finditer(text):
        span = m.group(2).strip()
        if "\n\n" in span or not re.match(r"^(\S*/)?(duetime|make)\s", span):
            continue
        line = numbers[text.count("\n", 0, m.start())]
        for program, argv in _commands(span.replace("\n", " ")):
            yield Quote(path, line, program, tuple(argv), mention=True)


def _makefile_quotes() -> Iterator[Quote]:
    """`duetime` calls in the recipes: `make run` runs them as they stand."""
    lines = MAKEFILE.read_text(encoding="utf-8").splitlines()
    pending: list[str] = []
    start = 0
    for n, line in enumerate(lines, 1):
        if not pending:
            start = n
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        joined = " ".join([*pending, line])
        pending = []
        if joined.startswith("\t"):  # a recipe line
            for program, argv in _commands(joined.replace("$(BIN)/duetime", "duetime")):
                if program == "duetime":
                    yield Quote(MAKEFILE, start, program, tuple(argv), mention=False)


def all_quotes() -> list[Quote]:
    quotes = [q for p in DOCS for q in markdown_quotes(p)] + list(_makefile_quotes())
    return list(dict.fromkeys(quotes))  # `a|b` variants repeat what they share


def make_targets() -> set[str]:
    targets = set()
    for line in MAKEFILE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([^\s#=:$][^=:]*?)\s*::?(?!=)", line)  # `a b: deps`, not `X := 1`
        if m:
            targets.update(m.group(1).split())
    return targets


# ---------------------------------------------------------------- checking


def _quiet_help(ctx: Any, param: Any, value: bool) -> None:
    if value:  # --help stops parsing where click would, without printing the page
        raise typer.Exit()


# Options whose values are policy names, which the commands check only when they run.
_POLICY_OPTIONS = {"policy": False, "policies": True}  # name -> comma-separated list


def _known_policies(ctx: Any, param: Any, value: Any) -> Any:
    """Refuse a policy name the registry lacks, as a click error naming it."""
    names = str(value).split(",") if _POLICY_OPTIONS[param.name] else [str(value)]
    unknown = [n for n in names if n not in available_policies()]
    if value is not None and unknown:
        raise BadParameter(f"unknown policy {', '.join(unknown)}", ctx=ctx, param=param)
    return value


def cli() -> Any:
    """The click command for ``app`` with callbacks made safe to run at parse time.

    A fresh command each call, so the callbacks swapped here leave the app as it is.
    Policy-name options get a check of their values against the registry.
    """
    root = typer.main.get_command(app)
    unknown = []
    todo = [root]
    while todo:
        cmd = todo.pop()
        todo.extend(getattr(cmd, "commands", {}).values())
        cmd.get_help_option(cmd.context_class(cmd)).callback = _quiet_help
        for param in cmd.params:
            if param.name in _POLICY_OPTIONS and param.callback is None:
                param.callback = _known_policies
                continue
            inner = getattr(param.callback, "__wrapped__", param.callback)
            if inner in _SKIPPED_CALLBACKS:
                param.callback = None
            elif inner is not None and inner not in _PURE_CALLBACKS:
                unknown.append(f"{cmd.name} {param.opts}: {inner.__qualname__}")
    assert not unknown, (
        "new option callbacks: add each to _PURE_CALLBACKS if it only checks a value, "
        f"else to _SKIPPED_CALLBACKS: {unknown}"
    )
    return root


# A value to fill in: N, NAME, <seed> (read as SEED), or one letter (`--seed s`, the
# seed of a table row). A doc may write it where an int goes; the rest of the line is
# still checked.
_PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|[a-z])$")


def _parse(root: Any, argv: list[str]) -> str | None:
    """Parse ``duetime *argv`` level by level; raises what click raises, returns
    what is left over. Nothing is run."""
    cmd, name, parent, args = root, "duetime", None, argv
    while True:
        group = hasattr(cmd, "commands")
        if group and not args:
            return None  # `duetime bench`: a group named in prose
        ctx = cmd.make_context(
            name, list(args), parent=parent, allow_extra_args=True, resilient_parsing=False
        )
        # What is left once this level's options are read, gathered as click's
        # own shell completion does.
        rest = [*ctx._protected_args, *ctx.args]
        if not group:
            extra = [a for a in rest if a != "..."]  # "...": more options, elided
            return f"unexpected argument(s) {' '.join(extra)}" if extra else None
        if not rest:
            return None
        name, cmd, args = cmd.resolve_command(ctx, rest)
        parent = ctx


def _without_placeholders(argv: list[str], param: Any) -> list[str] | None:
    """``argv`` less the options of ``param`` whose values are placeholders, or None
    when a value given is a real one (then the error stands)."""
    at = [i for i, a in enumerate(argv[:-1]) if param is not None and a in param.opts]
    if not at or not all(_PLACEHOLDER.match(argv[i + 1]) for i in at):
        return None
    return [a for i, a in enumerate(argv) if i not in at and i - 1 not in at]


def parse_error(root: Any, argv: tuple[str, ...], mention: bool = False) -> str | None:
    """Why ``duetime *argv`` would not parse, or None."""
    args = list(argv)
    dropped: set[str] = set()  # options whose placeholder values were taken out
    while True:
        try:
            return _parse(root, args)
        except (typer.Exit, NoArgsIsHelpError):
            return None  # --help, or a group named alone
        except MissingParameter as e:
            if mention or (e.param is not None and e.param.name in dropped):
                return None
            return str(e.format_message())
        except BadOptionUsage as e:
            if mention and e.option_name == argv[-1]:
                return None  # `duetime sim --predictor`: an option named, not used
            return str(e.format_message())
        except BadParameter as e:
            fewer = _without_placeholders(args, e.param)
            if fewer is None:
                return str(e.format_message())
            args = fewer  # the rest of the line is still checked
            dropped.add(e.param.name)
        except typer.TyperException as e:
            return str(e.format_message())


def mismatches(quotes: list[Quote]) -> list[str]:
    root, targets = cli(), make_targets()
    bad = []
    for q in quotes:
        if q.program == "make":
            missing = [t for t in q.argv if not t.startswith("-") and "=" not in t]
            missing = [t for t in missing if t not in targets]
            if missing:
                bad.append(f"{q.where()}: no Makefile target {', '.join(missing)}")
        elif (why := parse_error(root, q.argv, q.mention)) is not None:
            bad.append(f"{q.where()}: {why}")
    return bad
