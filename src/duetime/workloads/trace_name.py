"""Telling a trace file that is not there from a workload name that does not exist.

A `--workload` that is neither a generated workload nor an existing file is either a
trace path mistyped or a name mistyped; `sim`, `sweep` and `load` each say which, in
one line naming the option or the names they take.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_trace_exists"]


def check_trace_exists(name: str, takes: str) -> None:
    """Refuse a ``--workload`` trace ``name`` that is no file: as a missing trace where it
    looks like a path (``.jsonl``, or a folder in it), else as an unknown workload,
    ``takes`` saying which names the command takes (``"use sharegpt, synthetic"``)."""
    if Path(name).exists():
        return
    if name.endswith(".jsonl") or "/" in name or (os.altsep or os.sep) in name:
        raise ValueError(f"--workload {name}: the trace file does not exist")
    raise ValueError(f"unknown workload {name!r}: {takes} or the path of a JSONL trace file")
