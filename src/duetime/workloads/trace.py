"""JSONL workload traces: one job per line, written atomically, read with line-exact errors.

A line holds ``rid``, ``arrival`` (seconds), ``prompt_len``, ``output_len`` and
optionally ``max_tokens`` (default 4096), ``deadline`` (absolute seconds),
``priority``, ``klass``, ``tuf`` ``{ert, beta, alpha}``, ``segments``,
``segment_gaps``, ``segment_gap_estimates``, ``overrun`` (``"kill"`` or ``"skip-next"``),
``kv_eviction`` (``"off"``, ``"auto"`` or a ratio in [0, 1)), and ``prefix_group`` with
``prefix_len`` (the first ``prefix_len`` prompt tokens are the group's shared prefix,
what a simulated prefix cache reuses) -- the fields of
:class:`~duetime.core.request.Job`. Types are
strict (``"5"`` or ``5.0`` is not a token count; ``5`` is a valid arrival time),
unknown fields are errors (a typo must not silently fall back to a default), and
so is a key given twice in one line (JSON would silently keep the last).
Blank lines, a UTF-8 byte-order mark and CRLF line ends are accepted. Lines need
not be in arrival order: jobs come back sorted by arrival, ties in file order,
rids as written. :func:`read_trace_lines` also says which line each job came
from and which fields that line gave (a line's ``priority: 0`` and a line
without ``priority`` make the same :class:`Request`).

Any problem raises :class:`TraceError` with a message that stands alone, e.g.
``trace.jsonl:7: field 'prompt_len': must be >= 1, got 0``. :func:`write_trace`
checks each job by the same rules, so what it writes can always be read back.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from duetime.core.request import MAX_TIME_S, MAX_TUF_MAGNITUDE, Job, Request, TimeUtility
from duetime.workloads._files import atomic_writer

# What Request assumes when a line gives no max_tokens.
_DEFAULT_MAX_TOKENS = Request(rid=0, arrival=0.0, prompt_len=1).max_tokens


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, line and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _TufLine(_Strict):
    ert: float = Field(ge=0, le=MAX_TIME_S)
    beta: float = Field(default=1.0, ge=-MAX_TUF_MAGNITUDE, le=MAX_TUF_MAGNITUDE)
    alpha: float = Field(default=-2.0, ge=-MAX_TUF_MAGNITUDE, le=0)


class _JobLine(_Strict):
    rid: int = Field(ge=0)
    arrival: float = Field(ge=0, le=MAX_TIME_S)
    prompt_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    deadline: float | None = Field(default=None, le=MAX_TIME_S)
    priority: int = 0
    klass: str = Field(default="default", min_length=1)
    tuf: _TufLine | None = None
    segments: list[Annotated[int, Field(ge=1)]] = []
    segment_gaps: list[Annotated[float, Field(ge=0, le=MAX_TIME_S)]] = []
    segment_gap_estimates: list[Annotated[float, Field(ge=0, le=MAX_TIME_S)]] = []
    overrun: Literal["kill", "skip-next"] | None = None
    kv_eviction: Any = None  # checked below: one message for a union (not one per branch)
    prefix_group: str | None = Field(default=None, min_length=1)
    prefix_len: int | None = Field(default=None, ge=1)

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


def _shown(value: Any, limit: int = 60) -> str:
    """A value quoted in a message: JSON, cut short (a bad field may hold a megabyte)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _name(part: str | int, limit: int = 40) -> str:
    """A field name as printed: unprintable characters escaped, so a message stays one line."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(part))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(error: Any) -> tuple[str, str]:
    """(field path, short message) for one pydantic error."""
    loc = error["loc"]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{_name(p)}" for p in loc).lstrip(".")
    kind, ctx = error["type"], error.get("ctx", {})
    if kind in ("greater_than_equal", "less_than_equal"):
        op, bound = (">=", ctx["ge"]) if kind == "greater_than_equal" else ("<=", ctx["le"])
        message = f"must be {op} {bound}"
    elif kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
    else:
        message = _MESSAGES.get(kind, error["msg"])
    if kind not in ("missing", "extra_forbidden"):
        message += f", got {_shown(error['input'])}"
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
    if line.segment_gap_estimates and len(line.segment_gap_estimates) != len(line.segment_gaps):
        return "segment_gap_estimates", (
            f"needs one entry per segment gap ({len(line.segment_gaps)}), "
            f"got {len(line.segment_gap_estimates)}"
        )
    if (line.prefix_group is None) != (line.prefix_len is None):
        given, missing = (
            ("prefix_group", "prefix_len")
            if line.prefix_len is None
            else ("prefix_len", "prefix_group")
        )
        return given, f"given without {missing}"
    if line.prefix_len is not None and line.prefix_len > line.prompt_len:
        return "prefix_len", f"must be <= prompt_len ({line.prompt_len}), got {line.prefix_len}"
    return None


def _to_job(line: _JobLine, where: str) -> Job:
    tuf = None if line.tuf is None else TimeUtility(**line.tuf.model_dump())
    try:
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
            prefix_group=line.prefix_group,
            prefix_len=line.prefix_len or 0,
        )
        return Job(
            request,
            line.output_len,
            tuple(line.segments),
            tuple(line.segment_gaps),
            tuple(line.segment_gap_estimates),
        )
    except ValueError as e:  # a rule of Request/Job not mirrored above
        raise TraceError(f"{where}: {e}") from None


class _RepeatedKeyError(Exception):
    """A key given twice in one JSON object: ``json`` would silently keep the last value."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: a dict, refusing a repeated key."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKeyError(key)
        seen.add(key)
    return dict(pairs)


def _parse(text: str, where: str) -> Any:
    """One line's JSON value; every way it can fail is a :class:`TraceError` naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    except _RepeatedKeyError as e:
        raise TraceError(f"{where}: field '{_name(e.key)}': given more than once") from None
    except RecursionError:
        raise TraceError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise TraceError(f"{where}: invalid JSON: {_name(str(e), 120)}") from None


def _validate(raw: Any, where: str) -> _JobLine:
    """``raw`` (one line's JSON value) checked by every rule of the format."""
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
    return line


# Bytes that are not UTF-8, as ``errors="surrogateescape"`` decodes them.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One job of a trace, with the 1-based ``number`` of its line and the fields it ``given``.

    ``given`` is what a :class:`Request` cannot say: whether a field holding its
    default (``priority: 0``) was written in the line or left out.
    """

    number: int
    job: Job
    given: frozenset[str]


def read_trace_lines(path: str | Path) -> list[TraceLine]:
    """The jobs of a JSONL trace with their lines, sorted by arrival (stable).

    Raises :class:`TraceError`.
    """
    lines: list[TraceLine] = []
    first_seen: dict[int, int] = {}
    try:
        # utf-8-sig drops a byte-order mark; surrogateescape lets a byte that is not UTF-8
        # through, to be reported with its line number below.
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
            for number, text in enumerate(f, start=1):
                where = f"{path}:{number}"
                bad = _NOT_UTF8.search(text)
                if bad is not None:
                    byte = ord(bad.group()) - 0xDC00
                    raise TraceError(
                        f"{where}: not UTF-8 text (byte 0x{byte:02x} at column {bad.start() + 1})"
                    )
                if not text.strip():
                    continue
                line = _validate(_parse(text, where), where)
                if line.rid in first_seen:
                    raise TraceError(
                        f"{where}: field 'rid': duplicate rid {line.rid} "
                        f"(first on line {first_seen[line.rid]})"
                    )
                first_seen[line.rid] = number
                job = _to_job(line, where)
                lines.append(TraceLine(number, job, frozenset(line.model_fields_set)))
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    lines.sort(key=lambda line: line.job.request.arrival)
    return lines


def read_trace(path: str | Path) -> list[Job]:
    """Jobs of a JSONL trace, sorted by arrival (stable). Raises :class:`TraceError`."""
    return [line.job for line in read_trace_lines(path)]


def _int(value: Any) -> Any:
    """An integer of any kind (numpy's too) as an int; anything else as is, for the check."""
    return (
        int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    )


def _float(value: Any) -> Any:
    """A real number as a float, as the reader returns it (``5`` is written ``5.0``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int past float range: left for the check to refuse
            return value
    return value


def job_to_dict(job: Job) -> dict[str, Any]:
    """One trace line as a dict; optional fields are left out when they hold their default.

    Numbers are spelled as :func:`read_trace` gives them back (times as floats,
    counts as ints), so a trace read and written again is the same file.
    """
    r = job.request
    line: dict[str, Any] = {
        "rid": _int(r.rid),
        "arrival": _float(r.arrival),
        "prompt_len": _int(r.prompt_len),
        "output_len": _int(job.output_len),
        "max_tokens": _int(r.max_tokens),
    }
    if r.deadline is not None:
        line["deadline"] = _float(r.deadline)
    if r.priority:
        line["priority"] = _int(r.priority)
    if r.klass != "default":
        line["klass"] = r.klass
    if r.tuf is not None:
        tuf = r.tuf
        line["tuf"] = {"ert": _float(tuf.ert), "beta": _float(tuf.beta), "alpha": _float(tuf.alpha)}
    if job.segments:
        line["segments"] = [_int(n) for n in job.segments]
    if job.segment_gaps:
        line["segment_gaps"] = [_float(gap) for gap in job.segment_gaps]
    if job.segment_gap_estimates:
        line["segment_gap_estimates"] = [_float(gap) for gap in job.segment_gap_estimates]
    if r.overrun is not None:
        line["overrun"] = r.overrun
    if r.kv_eviction is not None:
        eviction = r.kv_eviction
        line["kv_eviction"] = eviction if isinstance(eviction, str) else _float(eviction)
    if r.prefix_group is not None:
        line["prefix_group"] = r.prefix_group
        line["prefix_len"] = _int(r.prefix_len)
    return line


def write_trace(path: str | Path, jobs: Iterable[Job]) -> int:
    """Write ``jobs`` as JSONL, all or nothing: if anything fails, ``path`` is left as it was.

    Each job is checked by the reader's rules first: one the reader would refuse
    (a deadline before arrival, a NaN, two jobs with one rid) raises
    :class:`TraceError` naming it, instead of leaving a file no command can read.
    Returns the number of lines written. Policy-side fields (``predicted``,
    ``prompt_token_ids``) are not part of the format and are not written.
    """
    return write_trace_lines(path, trace_lines(jobs, path))


def trace_lines(jobs: Iterable[Job], path: str | Path) -> list[str]:
    """The lines :func:`write_trace` would write to ``path``, checked as it checks them:
    a caller takes them before a run and writes them (:func:`write_trace_lines`) only
    once the run succeeded, so a failed run leaves no trace file."""
    lines: list[str] = []
    first_seen: dict[int, int] = {}
    for count, job in enumerate(jobs, start=1):
        line = job_to_dict(job)
        where = f"cannot write {path}: job {count} (rid {_shown(line['rid'])})"
        checked = _validate(line, where)
        if checked.rid in first_seen:
            raise TraceError(f"{where}: field 'rid': also the rid of job {first_seen[checked.rid]}")
        first_seen[checked.rid] = count
        lines.append(json.dumps(line, allow_nan=False, separators=(",", ":")) + "\n")
    return lines


def write_trace_lines(path: str | Path, lines: list[str]) -> int:
    """Write lines from :func:`trace_lines` to ``path``, all or nothing; returns how many."""
    with atomic_writer(Path(path)) as f:
        f.writelines(lines)
    return len(lines)
