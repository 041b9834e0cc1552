"""Records → numpy columns: the one pass over Python objects every metric shares.

At 100,000 records each per-record Python operation costs tens of
milliseconds, so we touch every record exactly once here and do all the
arithmetic on arrays afterwards. Missing values (no first token, no finish,
no deadline, no TUF) become NaN so that masks, not branches, decide who
counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from duetime.core.record import RequestRecord

_NAN = math.nan


def _floats(values: Iterable[float | None], n: int) -> np.ndarray:
    """A float64 array in which None becomes NaN.

    ``np.fromiter`` over a generator that maps None itself is about twice as
    fast as ``np.array(list_with_nones, dtype=float)``, which takes a slow
    path as soon as it meets a None.
    """
    return np.fromiter((_NAN if v is None else v for v in values), np.float64, count=n)


def _flatten(lists: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists → (flat float64 values, int64 length of each list)."""
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.float64, count=int(lens.sum()))
    return flat, lens


@dataclass(slots=True, frozen=True)
class Columns:
    """One array per record field, all of length ``n`` except the flat segment arrays.

    ``seg_done`` concatenates every record's ``segment_done`` (``seg_done_len``
    entries per record); likewise ``seg_ready``. A completed record that did
    not report segments gets ``[finish]``: an unsegmented answer is one
    segment that is done when the request finishes.
    """

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    cancelled_at: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    deadline: np.ndarray
    klass_code: np.ndarray
    klass_names: tuple[str, ...]
    tuf_ert: np.ndarray
    tuf_beta: np.ndarray
    tuf_alpha: np.ndarray
    seg_done: np.ndarray
    seg_done_len: np.ndarray
    seg_ready: np.ndarray
    seg_ready_len: np.ndarray

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord]) -> Columns:
        recs = list(records)
        n = len(recs)
        reqs = [r.request for r in recs]
        tufs = [q.tuf for q in reqs]
        has_tuf = any(t is not None for t in tufs)
        done_lists = [r.segment_done or ([r.finish] if r.finish is not None else []) for r in recs]
        seg_done, seg_done_len = _flatten(done_lists)
        seg_ready, seg_ready_len = _flatten([r.segment_ready for r in recs])
        return cls(
            arrival=_floats((q.arrival for q in reqs), n),
            first_token=_floats((r.first_token for r in recs), n),
            finish=_floats((r.finish for r in recs), n),
            cancelled_at=_floats((r.cancelled_at for r in recs), n),
            output_tokens=np.fromiter((r.output_tokens for r in recs), np.int64, count=n),
            preemptions=np.fromiter((r.num_preemptions for r in recs), np.int64, count=n),
            deadline=_floats((q.deadline for q in reqs), n),
            **_class_codes([q.klass for q in reqs]),
            tuf_ert=_floats((None if t is None else t.ert for t in tufs), n)
            if has_tuf
            else _nans(n),
            tuf_beta=_floats((None if t is None else t.beta for t in tufs), n)
            if has_tuf
            else _nans(n),
            tuf_alpha=_floats((None if t is None else t.alpha for t in tufs), n)
            if has_tuf
            else _nans(n),
            seg_done=seg_done,
            seg_done_len=seg_done_len,
            seg_ready=seg_ready,
            seg_ready_len=seg_ready_len,
        )

    @property
    def n(self) -> int:
        return len(self.arrival)

    @property
    def completed(self) -> np.ndarray:
        """``finish`` is set: the same rule as :attr:`RequestRecord.completed`."""
        return ~np.isnan(self.finish)

    @property
    def cancelled(self) -> np.ndarray:
        """Cancelled and not completed (a record claiming both counts as completed)."""
        return ~np.isnan(self.cancelled_at) & ~self.completed

    def of_class(self, name: str) -> np.ndarray:
        """Mask of the requests whose ``request.klass`` is ``name``."""
        return self.klass_code == self.klass_names.index(name)

    @property
    def has_tuf(self) -> np.ndarray:
        return ~np.isnan(self.tuf_beta)

    def last_event(self) -> float | None:
        """Latest finish, cancellation, first token, segment completion or arrival.

        For a run where everything completed this is the last finish; a
        cancellation after it extends the run, because the executor was still
        holding that request until then.
        """
        if self.n == 0:
            return None
        parts = (self.finish, self.cancelled_at, self.first_token, self.seg_done, self.arrival)
        return float(max(np.nanmax(p, initial=-math.inf) for p in parts))


def _nans(n: int) -> np.ndarray:
    return np.full(n, _NAN)


def _class_codes(names: list[str]) -> dict[str, Any]:
    """Class names as int codes into the sorted distinct names.

    Integer masks are ~10x faster than comparing or sorting an object array of
    strings, and a run has a handful of classes but up to 10^5 requests.
    """
    first_seen: dict[str, int] = {}
    codes = np.fromiter(
        (first_seen.setdefault(k, len(first_seen)) for k in names), np.int64, count=len(names)
    )
    ordered = sorted(first_seen)
    remap = np.array([ordered.index(k) for k in first_seen], dtype=np.int64)
    return {"klass_code": remap[codes] if len(codes) else codes, "klass_names": tuple(ordered)}
