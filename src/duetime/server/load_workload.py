"""What `duetime load` sends: prompts, lengths, arrival offsets, classes, deadlines, priorities.

A workload is built with the same pieces as the simulator's (:mod:`duetime.workloads`):
ShareGPT prompts with their true answer lengths, synthetic lengths, or a JSONL
trace, with Poisson or gamma arrivals, all seeded. What a load generator adds
is text and classes:

- ShareGPT requests carry their real prompt text; synthetic and trace requests
  get filler text of about ``prompt_len`` words (common English words, one
  token each in most tokenizers, so the length is approximate), starting with
  the request id so that no two prompts share a cacheable prefix.
- ``max_tokens`` is the request's output length, as in vLLM's serving
  benchmark; with ``--ignore-eos`` the server is asked to produce exactly that.
  That tells the server how long the answer is; ``fixed_max_tokens`` sends one
  limit instead, as a chat client does (vLLM's ``--sharegpt-output-len``).
- Each request gets a class drawn from ``class_mix`` (seeded, stream 3), and
  from its class a relative deadline and a priority. A trace names its own
  classes, deadlines and priorities; per-class options fill in what its lines
  leave out (a line's ``priority: 0`` is given, not left out: the trace reader
  says which fields a line had, which a :class:`Request` cannot).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from duetime.core.request import Job, TimeUtility
from duetime.server.body_fields import MAX_MS

if TYPE_CHECKING:
    from duetime.workloads.trace import TraceLine

ANY_CLASS = "*"  # key of a value given without a class name: it applies to every class
DEFAULT_CLASS = "default"

T = TypeVar("T")

# Common words, one token each (after a space) in the Gemma, Llama and GPT tokenizers.
_WORD_TEXT = """
    the of and to in is that it for on with as was at by be this from or have an they which one
    you were her all she there would their we him been has when who will more no if out so said
    what up its about into than them can only other new some could time these two may then do
    first any my now such like our over man me even most made after also did many before must
    through back years where much your way well down should because each just those people how
    too little state good very make world still own see men work long get here between both
    life being under never day same another know while last might us great old year off come
    since against go came right used take three
"""
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request to send. ``arrival`` is seconds after the run starts; ``deadline_s`` is
    relative to arrival (sent to the server as ``deadline_ms``, measured by the client)."""

    rid: int
    arrival: float
    prompt: str
    prompt_len: int
    max_tokens: int
    klass: str = DEFAULT_CLASS
    deadline_s: float | None = None
    priority: int | None = None
    overrun: str | None = None  # a trace's per-request TimeBill fields, sent as given
    kv_eviction: str | float | None = None
    tuf: TimeUtility | None = None  # a trace's time-utility function (TimelyLLM)


@dataclass(slots=True)
class LoadWorkload:
    """How to build the requests of one run; mirrors the options of `duetime sim`.

    ``workload``: ``sharegpt``, ``synthetic`` or a JSONL trace path (then
    ``arrival``, ``cv`` and the rate are ignored, and ``class_mix`` must be
    empty). Lengths are inclusive ``(lo, hi)`` token ranges for ``synthetic``.
    ``max_tokens`` caps outputs and ``max_context`` prompt + output: ShareGPT
    pairs outside are dropped, not clipped (see docs/workloads.md).
    ``fixed_max_tokens``: every ShareGPT request asks for this many tokens at most,
    not its recorded answer's length (pairs are drawn as without it, also leaving
    out prompts longer than ``max_context - fixed_max_tokens``).
    """

    workload: str = "sharegpt"
    requests: int = 100
    arrival: str = "poisson"
    cv: float = 1.0
    burst_size: int = 1
    seed: int = 0
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (16, 256)
    max_tokens: int = 1024
    max_context: int = 2048
    fixed_max_tokens: int | None = None
    class_mix: dict[str, float] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)

    @property
    def is_trace(self) -> bool:
        return self.workload not in ("sharegpt", "synthetic")

    def build(self, rate: float) -> list[LoadRequest]:
        """The requests of one run at ``rate`` requests/s, sorted by arrival."""
        from duetime.workloads.trace import read_trace_lines
        from duetime.workloads.trace_name import check_trace_exists

        lines: list[TraceLine] = []
        fixed = self.fixed_max_tokens
        if fixed is not None and self.workload != "sharegpt":
            raise ValueError("--fixed-max-tokens is for ShareGPT requests, which carry no limit")
        if fixed is not None and not 1 <= fixed < self.max_context:
            raise ValueError(
                f"--fixed-max-tokens must be in [1, --max-context {self.max_context}), got {fixed}"
            )
        if self.is_trace:
            check_trace_exists(self.workload, "load takes sharegpt, synthetic")
            if self.class_mix:
                raise ValueError("--class-mix cannot be used with a trace: it names its classes")
            lines = read_trace_lines(self.workload)[: self.requests]
            jobs = [line.job for line in lines]
            classes = [job.request.klass for job in jobs]
            self._check_names(set(classes))
            texts = None
        else:
            self._check_names(set(self.class_mix or [DEFAULT_CLASS]))
            jobs = self._jobs(rate)
            classes = self._classes(len(jobs))
            texts = [job.request.prompt_text for job in jobs]
        rng = np.random.default_rng([self.seed, 4])
        out = []
        for i, (job, klass) in enumerate(zip(jobs, classes, strict=True)):
            r = job.request
            text = texts[i] if texts is not None else None
            given = lines[i].given if lines else frozenset()
            where = f"{self.workload}:{lines[i].number}" if lines else ""
            deadline = r.time_budget
            if deadline is None:
                deadline = _lookup(self.deadlines, klass)
            elif not 0 < wire_ms(deadline) <= MAX_MS:  # the server refuses 0 and absurd ones
                raise ValueError(
                    f"{where}: field 'deadline': deadline - arrival = {deadline:g} s, sent as "
                    f"deadline_ms {wire_ms(deadline):g}; it must be > 0 and <= {MAX_MS:g}"
                )
            if self.is_trace and r.prompt_len + job.output_len > self.max_context:
                raise ValueError(
                    f"{where}: field 'prompt_len': prompt_len + output_len = "
                    f"{r.prompt_len + job.output_len} exceeds --max-context {self.max_context}"
                )
            problem = None if r.tuf is None else _tuf_problem(r.tuf)
            if problem is not None:
                raise ValueError(f"{where}: field 'tuf': {problem}")
            # a line's own priority wins, 0 included; only a missing one is filled in
            priority = r.priority if "priority" in given else _lookup(self.priorities, klass)
            out.append(
                LoadRequest(
                    rid=r.rid,
                    arrival=r.arrival,
                    prompt=text if text is not None else filler_prompt(r.rid, r.prompt_len, rng),
                    prompt_len=r.prompt_len,
                    max_tokens=job.output_len if fixed is None else fixed,
                    klass=klass,
                    deadline_s=deadline,
                    priority=priority,
                    overrun=r.overrun,
                    kv_eviction=r.kv_eviction,
                    tuf=r.tuf,
                )
            )
        return out

    def _jobs(self, rate: float) -> list[Job]:
        from duetime import workloads as wl

        arrivals = wl.arrival_process(self.arrival, rate, cv=self.cv, burst_size=self.burst_size)
        sharegpt = self.workload == "sharegpt"
        source = None if sharegpt else wl.SyntheticSource(self.prompt_len, self.output_len)
        fixed = self.fixed_max_tokens
        return wl.build_jobs(
            self.requests,
            source=source,
            arrivals=arrivals,
            seed=self.seed,
            caps=wl.LengthCaps(
                max_total_len=self.max_context,
                max_prompt_len=None if fixed is None else self.max_context - fixed,
            ),
            max_tokens=self.max_tokens,
            with_prompt_text=sharegpt,
        )

    def _classes(self, n: int) -> list[str]:
        if not self.class_mix:
            return [DEFAULT_CLASS] * n
        names = list(self.class_mix)
        weights = np.array([self.class_mix[k] for k in names], dtype=float)
        picks = np.random.default_rng([self.seed, 3]).choice(len(names), size=n, p=weights)
        return [names[i] for i in picks]

    def _check_names(self, known: set[str]) -> None:
        for option, values in (("--deadline", self.deadlines), ("--priority", self.priorities)):
            unknown = sorted(set(values) - known - {ANY_CLASS})
            if unknown:
                raise ValueError(
                    f"{option} names class {unknown[0]!r}, which no request can have "
                    f"(classes: {', '.join(sorted(known))})"
                )


def _lookup(values: dict[str, T], klass: str) -> T | None:
    return values.get(klass, values.get(ANY_CLASS))


def wire_ms(seconds: float) -> float:
    """Seconds as they are sent (``deadline_ms``, ``tuf.ert_ms``): milliseconds, to the µs.

    Checks use the sent value, not ``seconds``: a budget under half a microsecond
    is > 0 but goes out as 0, which servers refuse.
    """
    return round(seconds * 1000.0, 3)


def tuf_body(tuf: TimeUtility) -> dict[str, float]:
    """A time-utility function as the API takes it (``ert`` in milliseconds)."""
    return {"ert_ms": wire_ms(tuf.ert), "beta": tuf.beta, "alpha": tuf.alpha}


def _tuf_problem(tuf: TimeUtility) -> str | None:
    """Why duetime's server would refuse ``tuf`` (only it reads the field), or None."""
    from pydantic import ValidationError

    from duetime.server.body_fields import TUFSpec

    try:
        TUFSpec.model_validate(tuf_body(tuf))
    except ValidationError as e:
        error = e.errors()[0]
        return f"{error['loc'][0]} {error['input']!r} is refused by the server: {error['msg']}"
    return None


def filler_prompt(rid: int, prompt_len: int, rng: np.random.Generator) -> str:
    """About ``prompt_len`` tokens of words, led by the request id (no shared prefix)."""
    head = f"Request {rid}:"
    words = rng.choice(len(_WORDS), size=max(1, prompt_len - 5))
    return head + " " + " ".join(_WORDS[i] for i in words)


def parse_rates(text: str) -> list[float]:
    """``"1,2,4"`` → ``[1.0, 2.0, 4.0]``; ``inf`` sends everything at once."""
    from duetime.comma_lists import comma_numbers

    rates = comma_numbers("--rate", text, float, "numbers (requests/s)")
    if any(not r > 0 for r in rates):
        raise ValueError(f"--rate needs numbers > 0 (inf: all at once), got {text!r}")
    return rates


def parse_range(text: str, option: str) -> tuple[int, int]:
    """``"128"`` → ``(128, 128)``; ``"16-512"`` → ``(16, 512)``."""
    lo, _, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"{option} must be N or LO-HI token counts, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"{option} needs 1 <= LO <= HI, got {text!r}")
    return pair


def parse_class_values(items: Iterable[str], option: str, cast: Callable[[str], T]) -> dict[str, T]:
    """``["interactive=2", "batch=30"]`` or ``["interactive=2,batch=30"]`` → a dict.

    A bare value (``"5"``) applies to every class (key :data:`ANY_CLASS`).
    """
    values: dict[str, T] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            name, sep, raw = part.rpartition("=")
            name = name.strip() if sep else ANY_CLASS
            try:
                value = cast(raw.strip())
            except ValueError:
                raise ValueError(f"{option}: bad value in {part!r}") from None
            if not name:
                raise ValueError(f"{option}: empty class name in {part!r}")
            values[name] = value
    return values


def parse_deadlines(items: Iterable[str]) -> dict[str, float]:
    """Per-class relative deadlines in seconds, each > 0 and within what a server accepts."""
    values = parse_class_values(items, "--deadline", float)
    for name, v in values.items():
        if not (math.isfinite(v) and 0 < wire_ms(v) <= MAX_MS):
            which = "" if name == ANY_CLASS else f" for class {name!r}"
            raise ValueError(
                f"--deadline{which} must be a number of seconds > 0 and "
                f"<= {MAX_MS / 1000:g} (sent in ms, to the microsecond), got {v}"
            )
    return values


def parse_mix(text: str | None) -> dict[str, float]:
    """``"interactive=0.3,batch=0.7"`` → weights normalised to sum to 1."""
    if not text:
        return {}
    weights = parse_class_values([text], "--class-mix", float)
    if ANY_CLASS in weights:
        raise ValueError(f"--class-mix needs CLASS=WEIGHT pairs, got {text!r}")
    if any(not (math.isfinite(w) and w >= 0) for w in weights.values()):
        raise ValueError(f"--class-mix weights must be >= 0, got {text!r}")
    total = sum(weights.values())
    if not total > 0:
        raise ValueError(f"--class-mix weights must not all be zero, got {text!r}")
    return {name: w / total for name, w in weights.items()}
