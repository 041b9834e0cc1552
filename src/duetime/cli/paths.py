"""The command line's file options: each output checked writable before any work, and
no file taken by two options of one command where one of them writes it.

Click runs the options' callbacks in the order they were typed, so each side checks
the other's claims: ``--json a.csv --data a.csv`` and ``--data a.csv --json a.csv``
are refused alike. The claims live in the invocation's ``ctx.meta``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import typer

__all__ = ["input_list", "input_path", "output_path", "writable"]

#: The names of standard output: figures written there move the tables to standard error.
STDOUT_NAMES = ("/dev/stdout", "/proc/self/fd/1", "/dev/fd/1")
_OUTPUTS = "duetime.output_paths"
_INPUTS = "duetime.input_paths"


def _option(param: typer.CallbackParam) -> str:
    return "/".join(param.opts) if param.opts else str(param.name)


def writable(path: Path | None) -> Path | None:
    """Refuse an output path that cannot be written, before any work (the check of
    :func:`output_path`, the output options' callback).

    A benchmark that runs for minutes and then fails to save is the costliest
    typo; this tries a file in the nearest directory that exists (the final
    atomic write creates the rest), creating nothing. A device or pipe
    (``/dev/stdout``) is written in place, so it only needs to be writable.
    """
    from duetime.metrics.atomic import is_stream, prepare_parent

    if path is None:
        return None
    if is_stream(path):
        if not os.access(path, os.W_OK):
            raise typer.BadParameter(f"cannot write {path}: permission denied")
        return path
    try:
        with tempfile.TemporaryFile(dir=prepare_parent(path, create=False)):
            pass
    except OSError as e:
        raise typer.BadParameter(f"cannot write {path}: {e.strerror or e}") from None
    return path


def output_path(ctx: typer.Context, param: typer.CallbackParam, path: Path | None) -> Path | None:
    """Option callback for an output file: :func:`writable`, and no file given to two of
    the command's outputs (``--json r.json --plot r.json`` wrote the plot over the
    figures) nor to one of its inputs; a device such as ``/dev/null`` may take several.
    Figures sent to standard output send the command's tables to standard error."""
    from duetime.metrics.atomic import is_stream

    checked = writable(path)
    if checked is not None and str(checked) in STDOUT_NAMES:
        from duetime.cli.console import out

        out.to_stderr = True  # `--json /dev/stdout | jq` reads the JSON alone
    if checked is None or is_stream(checked):
        return checked
    where, option = checked.resolve(), _option(param)
    read = ctx.meta.setdefault(_INPUTS, {}).get(where)
    if read is not None:
        raise typer.BadParameter(f"{path} is also the {read} file: it would be written over")
    other = ctx.meta.setdefault(_OUTPUTS, {}).setdefault(where, option)
    if other != option:
        raise typer.BadParameter(f"{path} is also the {other} file: give each output its own")
    return checked


def _files_named(value: Any) -> list[Path]:
    """The existing files a value names: itself, each item of a list or of a comma-separated
    spec, and the path of a ``kind:path`` spec (``learned:m.npz``)."""
    items = value if isinstance(value, list | tuple) else [value]
    found = []
    for item in items:
        if item is None:
            continue
        text = str(item)
        for piece in [text, *text.split(","), *(p.split(":", 1)[-1] for p in text.split(","))]:
            if piece and Path(piece).is_file() and Path(piece) not in found:
                found.append(Path(piece))
    return found


def input_list(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """:func:`input_path` for a comma-separated list of specs where ``''`` names none."""
    if isinstance(value, str) and not value.strip():
        return value
    return input_path(ctx, param, value)


def input_path(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """Option callback for an input that may be a file (a CSV, a profile, a trace, a model;
    a list of them, or a ``learned:PATH`` spec): a file that exists is claimed, so that no
    output of the command is written over it (``advise batch --data a.csv --json
    a.csv`` replaced the measurements with the advice). A name that is not a file (a
    shipped profile, ``sharegpt``) claims nothing; the value is returned as given.

    A blank value is refused by name: ``--profile ''`` was read as the current
    directory ("Is a directory") and ``--workload ''`` as a trace path."""
    items = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(item, str) and not item.strip() for item in items):
        raise typer.BadParameter("is empty: give a name or a file")
    for item in items:  # click turns a blank path into "."
        if isinstance(item, Path) and item.is_dir():
            raise typer.BadParameter(f"{str(item)!r} is a directory: give a file")
    outputs: dict[Path, str] = ctx.meta.setdefault(_OUTPUTS, {})
    inputs: dict[Path, str] = ctx.meta.setdefault(_INPUTS, {})
    for item in _files_named(value):
        where = item.resolve()
        if where in outputs:
            raise typer.BadParameter(
                f"{item} is also the {outputs[where]} file: it would be written over"
            )
        inputs.setdefault(where, _option(param))
    return value
