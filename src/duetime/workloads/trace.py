"""JSONL workload traces: one job per line, written atomically, read with line-exact errors.

A line holds ``rid``, ``arrival`` (seconds), ``prompt_len``, ``output_len`` and
optionally ``max_tokens`` (default 4096), ``deadline`` (absolute seconds),
``priority``, ``klass``, ``tuf`` ``{ert, beta, alpha}``, ``segments``,
``segment_gaps``, ``overrun`` (``"kill"`` or ``"skip-next"``) and
``kv_eviction`` (``"off"``, ``"auto"`` or a ratio in [0, 1)) -- the fields of
:class:`~duetime.core.request.Job`. Types are
strict (``"5"`` or ``5.0`` is not a token count; ``5`` is a valid arrival time),
unknown fields are errors (a typo must not silently fall back to a default),
blank lines are ignored. Lines need not be in arrival order: jobs come back
sorted by arrival, ties in file order, rids as written.

Any problem raises :class:`TraceError` with a message that stands alone, e.g.
``trace.jsonl:7: field 'prompt_len': must be >= 1, got 0``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from duetime.core.request import Job, Request, TimeUtility
from duetime.workloads._files import atomic_writer

# What Request assumes when a line gives no max_tokens.
_DEFAULT_MAX_TOKENS = Request(rid=0, arrival=0.0, prompt_len=1).max_tokens


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, line and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _TufLine(_Strict):
    ert: float = Field(ge=0)
    beta: float = 1.0
    alpha: float = Field(default=-2.0, le=0)


class _JobLine(_Strict):
    rid: int = Field(ge=0)
    arrival: float = Field(ge=0)
    prompt_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    deadline: float | None = None
    priority: int = 0
    klass: str = Field(default="default", min_length=1)
    tuf: _TufLine | None = None
    segments: list[Annotated[int, Field(ge=1)]] = []
    segment_gaps: list[Annotated[float, Field(ge=0)]] = []
    overrun: Literal["kill", "skip-next"] | None = None
    kv_eviction: Any = None  # checked below: one message for a union (not one per branch)

    @field_validator("kv_eviction")
    @classmethod
    def _eviction(cls, value: Any) -> str | float | None:
        ok_ratio = isinstance(value, int | float) and not isinstance(value, bool)
        if value is None or value in ("off", "auto") or (ok_ratio and 0 <= value < 1):
            return float(value) if ok_ratio else value
        raise ValueError("must be 'off', 'auto' or a ratio in [0, 1)")


_MESSAGES = {
    "missing": "required field is missing",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "string_too_short": "must not be empty",
}


def _describe(error: Any) -> tuple[str, str]:
    """(field path, short message) for one pydantic error."""
    loc = error["loc"]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    kind, ctx = error["type"], error.get("ctx", {})
    if kind in ("greater_than_equal", "less_than_equal"):
        op, bound = (">=", ctx["ge"]) if kind == "greater_than_equal" else ("<=", ctx["le"])
        message = f"must be {op} {bound}"
    elif kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
    else:
        message = _MESSAGES.get(kind, error["msg"])
    if kind not in ("missing", "extra_forbidden"):
        message += f", got {json.dumps(error['input'])}"
    return field, message


def _cross_check(line: _JobLine) -> tuple[str, str] | None:
    """Rules that involve two fields, as (field, message); None if the line is consistent."""
    max_tokens = line.max_tokens or _DEFAULT_MAX_TOKENS
    if line.output_len > max_tokens:
        given = "" if line.max_tokens else " (the default; give max_tokens)"
        return "output_len", f"{line.output_len} exceeds max_tokens {max_tokens}{given}"
    if line.deadline is not None and line.deadline < line.arrival:
        return "deadline", f"must be >= arrival ({line.arrival}), got {line.deadline}"
    if line.segments and sum(line.segments) != line.output_len:
        return (
            "segments",
            f"must sum to output_len ({line.output_len}), sum is {sum(line.segments)}",
        )
    if line.segment_gaps and not line.segments:
        return "segment_gaps", "given without segments"
    if line.segment_gaps and len(line.segment_gaps) != len(line.segments) - 1:
        return "segment_gaps", (
            f"needs len(segments) - 1 = {len(line.segments) - 1} entries, "
            f"got {len(line.segment_gaps)}"
        )
    return None


def _to_job(line: _JobLine) -> Job:
    tuf = None if line.tuf is None else TimeUtility(**line.tuf.model_dump())
    request = Request(
        rid=line.rid,
        arrival=line.arrival,
        prompt_len=line.prompt_len,
        max_tokens=line.max_tokens or _DEFAULT_MAX_TOKENS,
        deadline=line.deadline,
        priority=line.priority,
        tuf=tuf,
        klass=line.klass,
        overrun=line.overrun,
        kv_eviction=line.kv_eviction,
    )
    return Job(request, line.output_len, tuple(line.segments), tuple(line.segment_gaps))


def read_trace(path: str | Path) -> list[Job]:
    """Jobs of a JSONL trace, sorted by arrival (stable). Raises :class:`TraceError`."""
    jobs: list[Job] = []
    first_seen: dict[int, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    raw = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(raw, dict):
                    raise TraceError(f"{where}: expected a JSON object, got {type(raw).__name__}")
                try:
                    line = _JobLine.model_validate(raw)
                except ValidationError as e:
                    field, message = _describe(e.errors()[0])
                    raise TraceError(f"{where}: field '{field}': {message}") from None
                problem = _cross_check(line)
                if problem is not None:
                    raise TraceError(f"{where}: field '{problem[0]}': {problem[1]}")
                if line.rid in first_seen:
                    raise TraceError(
                        f"{where}: field 'rid': duplicate rid {line.rid} "
                        f"(first on line {first_seen[line.rid]})"
                    )
                first_seen[line.rid] = number
                try:
                    jobs.append(_to_job(line))
                except ValueError as e:  # a rule of Request/Job not mirrored above
                    raise TraceError(f"{where}: {e}") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    jobs.sort(key=lambda job: job.request.arrival)
    return jobs


def job_to_dict(job: Job) -> dict[str, Any]:
    """One trace line as a dict; optional fields are left out when they hold their default."""
    r = job.request
    line: dict[str, Any] = {
        "rid": r.rid,
        "arrival": r.arrival,
        "prompt_len": r.prompt_len,
        "output_len": job.output_len,
        "max_tokens": r.max_tokens,
    }
    if r.deadline is not None:
        line["deadline"] = r.deadline
    if r.priority:
        line["priority"] = r.priority
    if r.klass != "default":
        line["klass"] = r.klass
    if r.tuf is not None:
        line["tuf"] = {"ert": r.tuf.ert, "beta": r.tuf.beta, "alpha": r.tuf.alpha}
    if job.segments:
        line["segments"] = list(job.segments)
    if job.segment_gaps:
        line["segment_gaps"] = list(job.segment_gaps)
    if r.overrun is not None:
        line["overrun"] = r.overrun
    if r.kv_eviction is not None:
        line["kv_eviction"] = r.kv_eviction
    return line


def write_trace(path: str | Path, jobs: Iterable[Job]) -> int:
    """Write ``jobs`` as JSONL, all or nothing: if anything fails, ``path`` is left as it was.

    Returns the number of lines written. Policy-side fields (``predicted``,
    ``prompt_token_ids``) are not part of the format and are not written.
    """
    count = 0
    with atomic_writer(Path(path)) as f:
        for job in jobs:
            f.write(json.dumps(job_to_dict(job), allow_nan=False, separators=(",", ":")) + "\n")
            count += 1
    return count
