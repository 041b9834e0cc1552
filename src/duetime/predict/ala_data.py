"""Throughput measurements for the ALA model: the CSV schema, reading, appending.

One row is one measured (or simulated) run: ``bb`` requests of exactly ``ii``
prompt tokens and ``oo`` output tokens all arrive at once on an engine allowed
``bb`` running sequences; ``thpt_tok_s = bb·oo / wall_s`` (the paper's
throughput). ``config`` names the hardware / software configuration the run
belongs to: ALA fits one model per configuration (its Algorithm 4).

The files are written by :mod:`duetime.predict.ala_collect` and shipped in
``duetime/data/ala/*.csv`` so tests and benchmarks never re-collect. A bad
file raises :class:`AlaDataError` naming ``file:line:column``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from duetime.metrics.atomic import named_error
from duetime.predict.ala_limits import MAX_BATCH, MAX_TOKENS

MAX_REP = 2**31 - 1
"""Largest repetition number a row may carry (any count of reps fits far below it)."""
COLUMNS = ("config", "source", "ii", "oo", "bb", "rep", "thpt_tok_s", "wall_s")
SOURCES = ("engine", "sim")


class AlaDataError(ValueError):
    """A throughput CSV is malformed; the message starts with ``file:line:column``."""


@dataclass(slots=True, frozen=True)
class Measurement:
    """One throughput run. ``rep`` numbers repeated runs of the same shape."""

    config: str
    source: str
    ii: int
    oo: int
    bb: int
    rep: int
    thpt_tok_s: float
    wall_s: float

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        """What makes a run unique (collection skips keys already in the file)."""
        return (self.config, self.ii, self.oo, self.bb, self.rep)


@dataclass(slots=True, frozen=True)
class ConfigData:
    """All runs of one configuration as parallel arrays (what the models consume)."""

    name: str
    ii: np.ndarray
    oo: np.ndarray
    bb: np.ndarray
    thpt: np.ndarray

    def __len__(self) -> int:
        return len(self.thpt)

    def pairs(self) -> list[tuple[int, int]]:
        """The distinct (ii, oo) workloads, sorted."""
        return sorted({(int(i), int(o)) for i, o in zip(self.ii, self.oo, strict=True)})

    def mask_pairs(self, pairs: Iterable[tuple[int, int]]) -> np.ndarray:
        """Boolean row mask selecting the given (ii, oo) pairs."""
        keep = set(pairs)
        return np.array([(int(i), int(o)) in keep for i, o in zip(self.ii, self.oo, strict=True)])

    def select(self, mask: np.ndarray) -> ConfigData:
        return ConfigData(self.name, self.ii[mask], self.oo[mask], self.bb[mask], self.thpt[mask])


def shipped_dir() -> Path:
    """``duetime/data/ala``: the measurements that ship with the package."""
    return Path(str(resources.files("duetime") / "data" / "ala"))


def _int(text: str, where: str, name: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise AlaDataError(f"{where}: {name} must be an integer, got {text!r}") from None
    broken = f">= {lo}" if v < lo else f"<= {hi:,}" if hi is not None and v > hi else None
    if broken is not None:
        raise AlaDataError(f"{where}: {name} must be {broken}, got {v}")
    return v


def _float(text: str, where: str, name: str, positive: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise AlaDataError(f"{where}: {name} must be a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise AlaDataError(f"{where}: {name} must be finite and {'>' if positive else '>='} 0")
    return v


def read_csv(path: str | Path) -> list[Measurement]:
    """Every row of one throughput CSV, validated."""
    path = Path(path)
    # The text is decoded (and split into fields) lazily as rows are read: a binary file,
    # or one in another encoding, fails mid-parse with an error that names no file.
    try:
        return _read_rows(path)
    except UnicodeDecodeError:
        raise AlaDataError(f"{path}: not UTF-8 text; expected a throughput CSV") from None
    except csv.Error as e:
        raise AlaDataError(f"{path}: not a throughput CSV ({e})") from None


def _read_rows(path: Path) -> list[Measurement]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise AlaDataError(f"{path}:1:1: empty file; expected the header {','.join(COLUMNS)}")
        if tuple(h.strip() for h in header) != COLUMNS:
            raise AlaDataError(
                f"{path}:1:1: header must be {','.join(COLUMNS)}, got {','.join(header)}"
            )
        rows: list[Measurement] = []
        for rec in reader:
            line = reader.line_num
            if not rec or all(not c.strip() for c in rec):
                continue
            if len(rec) != len(COLUMNS):
                raise AlaDataError(
                    f"{path}:{line}:{min(len(rec), len(COLUMNS)) + 1}: expected "
                    f"{len(COLUMNS)} fields, got {len(rec)}"
                )
            w = [f"{path}:{line}:{c + 1}" for c in range(len(COLUMNS))]
            cells = [c.strip() for c in rec]
            if not cells[0]:
                raise AlaDataError(f"{w[0]}: config must not be empty")
            if cells[1] not in SOURCES:
                raise AlaDataError(f"{w[1]}: source must be one of {SOURCES}, got {cells[1]!r}")
            rows.append(
                Measurement(
                    config=cells[0],
                    source=cells[1],
                    ii=_int(cells[2], w[2], "ii", 1, MAX_TOKENS),
                    oo=_int(cells[3], w[3], "oo", 1, MAX_TOKENS),
                    bb=_int(cells[4], w[4], "bb", 1, MAX_BATCH),
                    rep=_int(cells[5], w[5], "rep", 0, MAX_REP),
                    thpt_tok_s=_float(cells[6], w[6], "thpt_tok_s", positive=True),
                    wall_s=_float(cells[7], w[7], "wall_s", positive=False),
                )
            )
    return rows


def load(paths: Sequence[str | Path] | None = None) -> list[Measurement]:
    """Rows of the given CSVs (default: every shipped ``*.csv``); a file without rows
    raises :class:`AlaDataError` naming it (``done_keys`` still reads one as empty)."""
    if not paths:
        paths = sorted(shipped_dir().glob("*.csv"))
        if not paths:
            raise AlaDataError(f"{shipped_dir()}: no shipped throughput CSV files")
    rows: list[Measurement] = []
    for p in paths:
        got = read_csv(p)
        if not got:  # a header alone: nothing to fit, and no config to name
            raise AlaDataError(f"{p}: has no rows after the header; expected throughput runs")
        rows.extend(got)
    return rows


def by_config(rows: Iterable[Measurement]) -> dict[str, ConfigData]:
    """Group rows into per-configuration arrays (ALA fits one model per configuration)."""
    groups: dict[str, list[Measurement]] = {}
    for r in rows:
        groups.setdefault(r.config, []).append(r)
    return {
        name: ConfigData(
            name,
            np.array([r.ii for r in rs], dtype=np.int64),
            np.array([r.oo for r in rs], dtype=np.int64),
            np.array([r.bb for r in rs], dtype=np.int64),
            np.array([r.thpt_tok_s for r in rs], dtype=np.float64),
        )
        for name, rs in sorted(groups.items())
    }


def config_data(name: str, paths: Sequence[str | Path] | None = None) -> ConfigData:
    """One configuration's runs; an unknown name raises naming the known ones."""
    data = by_config(load(paths))
    if name not in data:
        raise AlaDataError(f"unknown throughput config {name!r}; known: {', '.join(data)}")
    return data[name]


def append_rows(path: str | Path, rows: Iterable[Measurement]) -> None:
    """Append rows (writing the header to a new file), flushed so an interrupt loses none."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _append(path, rows, new)
    except OSError as e:  # ENOSPC names no file: the error line must name the CSV
        raise named_error(e, path, str(path)) from None


def _append(path: Path, rows: Iterable[Measurement], new: bool) -> None:
    with path.open("a", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        if new:
            w.writerow(COLUMNS)
        elif not _ends_with_newline(path):  # an edited file: do not glue a row onto its last
            f.write("\n")
        for r in rows:
            cells = list(astuple(r))
            cells[6] = f"{r.thpt_tok_s:.6g}"
            cells[7] = f"{r.wall_s:.6g}"
            w.writerow(cells)
        f.flush()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) in (b"\n", b"\r")


def drop_torn_row(path: str | Path) -> str | None:
    """Cut an unfinished last row off ``path`` and return it (None if there is none).

    A collection killed while appending leaves a last line with no newline and too
    few fields; reading the file then fails on it, and the resumable collection
    stopped until the row was cut by hand. A last line with every field but no
    newline (a hand edit) is kept: the next append starts a line of its own.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0 or _ends_with_newline(path):
        return None
    data = path.read_bytes()
    start = data.rfind(b"\n") + 1
    tail = data[start:].decode("utf-8", errors="replace")
    if len(next(csv.reader([tail]), [])) >= len(COLUMNS):
        return None
    with path.open("r+b") as f:
        f.truncate(start)
    return tail


def done_keys(path: str | Path) -> set[tuple[str, int, int, int, int]]:
    """Keys already in ``path`` (empty if it does not exist yet)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return set()
    return {r.key for r in read_csv(path)}
